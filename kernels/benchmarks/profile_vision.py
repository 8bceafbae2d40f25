"""Where the vision tower's forward for one many-image request spends its time, operator by operator.

    python -m zipmoe.kernels.benchmarks.profile_vision --out docs/results/vision_profile_h200

Through the server on the H200, `vision_encoder`'s forward for 30 images of 512x512 (30 x 1,024
patches) took 95 ms at the 30B shape against roughly 45 ms of bf16 math (docs/PERFORMANCE.md).
This builds the same tower (`vision.VisionEncoder`, `load_format` dummy over
checkpoints/qwen3-vl-30b-a3b, bf16 on the GPU), times `features()` (the forward, the importance
kernel, the budget weighting and the copy of importance and keys to the host) with the device
synchronised, then profiles one call with torch.profiler: the device kernels by total time (with
their launches), the GPU's busy time and idle gaps inside the call (and the kernel after each gap),
and the host operators by self time, so the next target is visible.
Writes OUT.json {device, images, size, features_ms, kernel_ms, kernels: [...], host_ops: [...]}.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from zipmoe.clients.bench_common import parse_size
from zipmoe.serve import REAL_SHAPE_CHECKPOINT
from zipmoe.vision import VisionEncoder

from .profile_decode import short_name
from .timing import wall_ms, write_result


CALL = "features"  # the profiler label of the profiled call


def profile_features(encoder: VisionEncoder, images: list[torch.Tensor], top: int) -> dict:
    cuda = encoder.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        with record_function(CALL):
            encoder.features(images)
        if cuda:
            torch.cuda.synchronize()
    timeline = gpu_timeline(prof.events()) if cuda else {}
    events = prof.key_averages()
    kernels = sorted(((short_name(e.key), e.device_time_total / 1e3, e.count) for e in events
                      if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time_total > 0
                      and e.key != CALL),
                     key=lambda k: -k[1])
    host = sorted(((e.key, e.self_cpu_time_total / 1e3, e.count) for e in events
                   if e.device_type == torch.autograd.DeviceType.CPU and e.self_cpu_time_total > 0),
                  key=lambda k: -k[1])
    total = sum(ms for _, ms, _ in kernels)
    return {"kernel_ms": round(total, 2), **timeline,
            "kernels": [{"kernel": name, "ms": round(ms, 3), "share": round(ms / total, 4) if total else 0.0,
                         "launches": count} for name, ms, count in kernels[:top]],
            "host_ops": [{"op": name, "self_ms": round(ms, 3), "calls": count} for name, ms, count in host[:top]]}


def gpu_timeline(events, gaps: int = 8) -> dict:
    """When the GPU worked inside the profiled features() call: the wait before its first kernel,
    the time it was busy (kernels' intervals merged), and its longest idle gaps, each with the
    kernel that ended the gap. A GPU idle while the host works is time the host, not the math, costs."""
    call = next(e for e in events if e.name == CALL and e.device_type == torch.autograd.DeviceType.CPU)
    # The labelled range also appears as a device-side event spanning the call's kernels: not a kernel.
    kernels = sorted((e.time_range.start, e.time_range.end, short_name(e.name)) for e in events
                     if e.device_type == torch.autograd.DeviceType.CUDA and e.name != CALL
                     and e.time_range.end > e.time_range.start)
    if not kernels:
        return {}
    busy, idle, end = 0.0, [], kernels[0][0]
    for start, stop, name in kernels:
        if start > end:
            idle.append((start - end, name))
        busy += max(0.0, stop - max(start, end))
        end = max(end, stop)
    idle.sort(reverse=True)
    return {"call_ms": round((call.time_range.end - call.time_range.start) / 1e3, 2),
            "first_kernel_after_ms": round((kernels[0][0] - call.time_range.start) / 1e3, 2),
            "gpu_busy_ms": round(busy / 1e3, 2), "gpu_idle_ms": round(sum(g for g, _ in idle) / 1e3, 2),
            "last_kernel_end_after_ms": round((end - call.time_range.start) / 1e3, 2),
            "idle_gaps": [{"ms": round(g / 1e3, 3), "before": name} for g, name in idle[:gaps]]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--checkpoint", default=str(REAL_SHAPE_CHECKPOINT))
    ap.add_argument("--load-format", default="dummy", choices=("auto", "dummy"))
    ap.add_argument("--images", type=int, default=30)
    ap.add_argument("--size", default="512x512", help="WIDTHxHEIGHT of every image (multiples of patch x merge)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--top", type=int, default=25, help="kernels and host operators kept")
    ap.add_argument("--unfused", action="store_true",
                    help="transformers' own LayerNorm, residual add and GELU instead of the fused ones (to compare)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    encoder = VisionEncoder(args.checkpoint, device, dtype, load_format=args.load_format)
    encoder.fused_ops = encoder.fused_ops and not args.unfused
    width, height = parse_size(args.size)
    g = torch.Generator().manual_seed(0)
    # Normalised CHW, already on the device, as image_decode hands them over on a GPU.
    images = [torch.randn(3, height, width, generator=g).to(device) for _ in range(args.images)]
    features_ms = wall_ms(lambda: encoder.features(images), device.type == "cuda", args.reps)
    result = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "images": args.images,
              "size": args.size, "fused_ops": encoder.fused_ops, "features_ms": round(features_ms, 2), **profile_features(encoder, images, args.top)}
    print(f"features(): {features_ms:.1f} ms for {args.images} images of {args.size}; "
          f"kernels {result['kernel_ms']:.1f} ms", flush=True)
    for k in result["kernels"]:
        print(f"  {k['ms']:8.2f} ms {100 * k['share']:5.1f} %  x{k['launches']:<5d} {k['kernel']}")
    if "gpu_busy_ms" in result:
        print(f"profiled call {result['call_ms']:.1f} ms: first kernel after {result['first_kernel_after_ms']:.1f} ms, "
              f"GPU busy {result['gpu_busy_ms']:.1f} ms, idle {result['gpu_idle_ms']:.1f} ms; longest gaps:")
        for gap in result["idle_gaps"]:
            print(f"  {gap['ms']:8.2f} ms before {gap['before']}")
    print("host operators by self time:")
    for op in result["host_ops"][:12]:
        print(f"  {op['self_ms']:8.2f} ms  x{op['calls']:<5d} {op['op']}")
    if args.out:
        write_result(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
