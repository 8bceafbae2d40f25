"""Decode with the experts split over processes (expert parallel) against one process (issue 19).

    python -m zipmoe.kernels.benchmarks.bench_expert_parallel --out docs/results/scale_h200x2
        [--checkpoint DIR] [--load-format dummy] [--device cuda] [--sizes 1,2] [--batches 1,16,64]
        [--policies topk,oea]

For each expert_parallel_size, routing policy and decode batch: the engine (engine/parallel_engine.py
for sizes > 1) with B 256-token random prompts in decode, 3 warm-up steps, then the median wall time
of 24 `engine.step()` calls (TPOT, rank 0's view: scheduling, the broadcast of the step to the other
processes, the forward with its all-reduces, sampling), and the bytes of weights rank 0 holds. The
default checkpoint is the real shape with dummy weights on the GPU; `--checkpoint checkpoints/tiny
--device cpu` runs the same thing on a CPU over gloo (plumbing, not speed). `sere` needs the
checkpoint's calibration (`zipmoe calibrate`) and is left out unless asked for.
Writes OUT.json ({"device", "rows": [{mode, gpus, routing, batch_or_concurrency, tpot_ms, ttft_ms,
out_tok_s, weight_gib_per_gpu, comm_us_per_step}]}); comm_us_per_step is not measured here (null).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch

from zipmoe.engine.engine import EngineConfig
from zipmoe.engine.parallel_engine import make_engine
from zipmoe.engine.sequence import SamplingParams
from zipmoe.serve import REAL_SHAPE_CHECKPOINT

from .timing import require_cuda

PROMPT, WARMUP, STEPS = 256, 3, 24


def weight_bytes(model) -> int:
    """Bytes of the tensors this process's model holds (the LM head counted once when tied)."""
    seen, total = set(), 0
    tensors = [model.embed, model.norm, model.lm_head] + [t for layer in model.layers for t in vars(layer).values()
                                                          if isinstance(t, torch.Tensor)]
    for t in tensors:
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total


def decode_rows(engine, size: int, policy: str, batches: list[int]) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    vocab, image = engine.text.vocab_size, engine.text.image_token_id

    def prompt() -> list[int]:  # text only: an image placeholder would want visual embeddings
        return [t if t != image else t - 1 for t in torch.randint(1, vocab, (PROMPT,), generator=g).tolist()]

    gib = round(weight_bytes(engine.model) / 2**30, 2)
    rows = []
    for B in batches:
        seqs = [engine.add_request(prompt(), SamplingParams(max_tokens=WARMUP + STEPS + 4, ignore_eos=True)) for _ in range(B)]
        t0 = time.perf_counter()
        while any(not s.output_ids for s in seqs):
            engine.step()
        ttft_ms = (time.perf_counter() - t0) * 1e3
        for _ in range(WARMUP):
            engine.step()
        times = []
        for _ in range(STEPS):
            t0 = time.perf_counter()
            engine.step()  # ends when the tokens are on the host
            times.append((time.perf_counter() - t0) * 1e3)
        for s in seqs:
            engine.abort(s)
        engine.step()  # the aborts reach the other processes
        tpot = statistics.median(times)
        rows.append({"mode": "single" if size == 1 else "expert_parallel", "gpus": size, "routing": policy,
                     "batch_or_concurrency": B, "tpot_ms": round(tpot, 3), "ttft_ms": round(ttft_ms, 1),
                     "out_tok_s": round(B / tpot * 1e3, 1), "weight_gib_per_gpu": gib, "comm_us_per_step": None})
        print(rows[-1], flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="docs/results/scale_h200x2")
    ap.add_argument("--checkpoint", default=str(REAL_SHAPE_CHECKPOINT))
    ap.add_argument("--load-format", default="dummy")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--sizes", default="1,2")
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--policies", default="topk,oea")
    args = ap.parse_args(argv)
    require_cuda(ap, args.device)
    batches = [int(b) for b in args.batches.split(",")]
    # One step at a time in every row: expert parallel never pipelines, so size 1 must not either.
    base = EngineConfig(device=args.device, load_format=args.load_format, num_kv_blocks=4096, max_model_len=2048,
                        max_num_seqs=max(batches), max_num_batched_tokens=max(8192, max(batches) * PROMPT),
                        async_scheduling=False)
    result = {"device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
              "checkpoint": args.checkpoint, "rows": []}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for size in (int(s) for s in args.sizes.split(",")):
        for policy in args.policies.split(","):
            engine = make_engine(args.checkpoint, replace(base, expert_parallel_size=size, routing_policy=policy))
            try:
                result["rows"] += decode_rows(engine, size, policy, batches)
            finally:
                engine.close()
                del engine
                if args.device.startswith("cuda"):
                    torch.cuda.empty_cache()
            out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    print(f"wrote {out.with_suffix('.json')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
