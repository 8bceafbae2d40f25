"""VisionZip patch importance: Triton kernel vs the materialised reference, next to the vision forward.

    python -m zipmoe.kernels.benchmarks.bench_importance [--images 30] [--patches 1024] [--out docs/results/importance_h200]

At the Qwen3-VL-30B-A3B vision shape (16 heads, d = 72, bf16), for `--images` images of `--patches`
patches: the median of CUDA-event timings (after warm-up) and the peak of
torch.cuda.max_memory_allocated over the allocation before the call, for the Triton kernel and
for `patch_importance_reference`, plus one forward of a randomly initialised vision tower of
the 30B's shape on the same patches, so the importance kernel can be read as a share of the
forward it is hooked into. CUDA only (it imports anywhere).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Callable

import torch
from transformers import Qwen3VLMoeConfig
from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import Qwen3VLMoeVisionModel

from zipmoe.kernels.attention_importance import patch_importance, patch_importance_reference

from .timing import cuda_time_us, peak_bytes, require_cuda

# Qwen3-VL-30B-A3B-Instruct's vision_config.
VISION_30B = dict(depth=27, hidden_size=1152, num_heads=16, intermediate_size=4304, patch_size=16,
                  temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=2048,
                  deepstack_visual_indexes=[8, 16, 24], num_position_embeddings=2304,
                  hidden_act="gelu_pytorch_tanh", in_channels=3)


def time_and_peak(fn: Callable[[], object], reps: int = 20) -> tuple[float, int]:
    """(median microseconds after warm-up, peak bytes allocated above the baseline in one call)."""
    return cuda_time_us(fn, reps=reps), peak_bytes(fn)


def vision_tower(device: torch.device, dtype: torch.dtype = torch.bfloat16, **overrides) -> Qwen3VLMoeVisionModel:
    """A randomly initialised vision tower, built the way `zipmoe.vision.VisionEncoder` builds it."""
    vcfg = Qwen3VLMoeConfig(vision_config={**VISION_30B, **overrides}).vision_config
    vcfg._attn_implementation = "sdpa"
    with torch.device(device):  # initialise in place: no CPU copy of ~0.4 B parameters
        model = Qwen3VLMoeVisionModel(vcfg)
    return model.to(dtype=dtype).eval()


def bench_importance(device: torch.device | str = "cuda", images: int = 30, patches: int = 1024, heads: int = 16,
                     d: int = 72, reps: int = 20, forward: bool = True, seed: int = 0) -> list[dict]:
    device = torch.device(device)
    if device.type != "cuda":
        raise RuntimeError("bench_importance times CUDA kernels; run it on a GPU")
    dtype = torch.bfloat16
    n = images * patches
    g = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(n, heads, d, generator=g, device=device).to(dtype)
    k = torch.randn(n, heads, d, generator=g, device=device).to(dtype)
    cu = torch.arange(0, n + 1, patches, device=device, dtype=torch.int32)
    scale = d ** -0.5
    qk_bytes = q.numel() * q.element_size() + k.numel() * k.element_size()
    common = {"bench": "importance", "batch": images, "policy": "", "union": 0.0, "patches_per_image": patches,
              "heads": heads, "head_dim": d, "dtype": "bf16"}

    rows = []
    for impl, fn in [("triton", lambda: patch_importance(q, k, cu, scale)),
                     ("materialised", lambda: patch_importance_reference(q, k, cu, scale))]:
        time_us, peak = time_and_peak(fn, reps=reps)
        rows.append({**common, "impl": impl, "time_us": time_us, "bytes_read": qk_bytes,
                     "gbps": qk_bytes / (time_us * 1e-6) / 1e9, "peak_mem_bytes": peak})
    del q, k

    if forward:
        model = vision_tower(device, dtype, num_heads=heads, hidden_size=heads * d)
        # Each image a 1 x 32 x 32 grid for the default 1024 patches; any square count works.
        side = int(round(patches ** 0.5))
        if side * side != patches:
            raise ValueError(f"--patches must be a square for the vision forward, got {patches}")
        cfg = model.config
        pixels = torch.randn(n, cfg.in_channels * cfg.temporal_patch_size * cfg.patch_size ** 2,
                             generator=g, device=device).to(dtype)
        grid = torch.tensor([[1, side, side]] * images, device=device)
        with torch.inference_mode():
            time_us, peak = time_and_peak(lambda: model(pixels, grid_thw=grid, return_dict=True), reps=reps)
        rows.append({**common, "impl": "vision_forward", "time_us": time_us, "bytes_read": 0, "gbps": 0.0,
                     "peak_mem_bytes": peak})
        for r in rows[:-1]:
            r["pct_of_vision_forward"] = 100.0 * r["time_us"] / time_us
    return rows


def print_table(rows: list[dict]) -> None:
    print(f"{'impl':16s} {'time_us':>12s} {'peak MiB':>10s} {'GB/s (q+k)':>11s} {'% of forward':>13s}")
    for r in rows:
        pct = f"{r['pct_of_vision_forward']:.2f}" if "pct_of_vision_forward" in r else "-"
        print(f"{r['impl']:16s} {r['time_us']:12.1f} {r['peak_mem_bytes'] / 2 ** 20:10.1f} {r['gbps']:11.1f} {pct:>13s}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--images", type=int, default=30)
    p.add_argument("--patches", type=int, default=1024, help="patches per image (a square, for the forward)")
    p.add_argument("--reps", type=int, default=20, help="timed repetitions; the median is reported")
    p.add_argument("--no-forward", action="store_true", help="skip the vision-tower forward")
    p.add_argument("--out", type=Path, default=None, help="also write OUT.json")
    args = p.parse_args(argv)
    require_cuda(p, args.device)
    rows = bench_importance(args.device, images=args.images, patches=args.patches, reps=max(20, args.reps),
                            forward=not args.no_forward)
    print(f"{torch.cuda.get_device_name()}: {args.images} images x {args.patches} patches, 16 heads, d=72, bf16")
    print_table(rows)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        result = {"device": torch.cuda.get_device_name(), "rows": rows}
        args.out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
