"""Paged decode attention at Qwen3-30B-A3B's shape: the Triton kernel vs the gather + SDPA path.

    python -m zipmoe.kernels.benchmarks.bench_paged_attention

One layer's decode attention (32 q heads, 4 kv heads, head_dim 128, bf16, block size 16) for
batch 1, 16, 64 at context 256, 1024 and 4096, each sequence on its own shuffled blocks; and the
kernel again at context 1024 with each block table padded to 32k keys, as a CUDA graph captured for
max_model_len 32768 pads it (rows with `table_keys`). Both paths
get what the runner builds once per step (block tables and lengths for the kernel; gather slots and
the mask for SDPA), so each time is the per-layer cost. Each path is captured in a CUDA graph and
timed by replay, as the engine runs decode; the L2 cache is flushed before every timed replay, as 48
layers' caches would flush it in a real step. CUDA only.
"""
from __future__ import annotations

import argparse
import torch
import torch.nn.functional as F

from zipmoe.kernels.paged_attention import paged_decode_attention

from .timing import graph_time_us, require_cuda

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 4, 128, 16
BATCHES = (1, 16, 64)
CONTEXTS = (256, 1024, 4096)
PADDED_TABLE_KEYS = 32768  # the served graphs' table width at max_model_len 32768


def _case(batch: int, context: int, device: torch.device, seed: int = 0, table_keys: int = 0):
    """q, the caches, block tables (padded with block 0 up to table_keys, when given) and lengths."""
    g = torch.Generator(device=device).manual_seed(seed)
    per_seq = context // BLOCK_SIZE
    num_blocks = batch * per_seq
    k = torch.randn(num_blocks * BLOCK_SIZE, KV_HEADS, HEAD_DIM, device=device, generator=g, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    q = torch.randn(batch, HEADS, HEAD_DIM, device=device, generator=g, dtype=torch.bfloat16)
    tables = torch.randperm(num_blocks, device=device, generator=g).view(batch, per_seq).to(torch.int32)
    if table_keys > context:
        tables = F.pad(tables, (0, table_keys // BLOCK_SIZE - per_seq))
    lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    return q, k, v, tables, lens


def bench_paged_attention(device) -> list[dict]:
    device = torch.device(device)
    scale = HEAD_DIM ** -0.5
    rows = []
    for context in CONTEXTS:
        for batch in BATCHES:
            q, k, v, tables, lens = _case(batch, context, device)
            # What the runner's gather path builds once per step and every layer reuses.
            t = tables.long()
            gather = (t[:, :, None] * BLOCK_SIZE + torch.arange(BLOCK_SIZE, device=device)).flatten(1)[:, :context]
            mask = (torch.arange(context, device=device)[None, :] < lens.long()[:, None])[:, None, None, :]

            def gather_sdpa():
                keys, vals = k[gather], v[gather]
                return F.scaled_dot_product_attention(q[:, :, None, :], keys.transpose(1, 2), vals.transpose(1, 2),
                                                      attn_mask=mask, scale=scale, enable_gqa=True)[:, :, 0, :]

            def triton_kernel():
                return paged_decode_attention(q, k, v, tables, lens, BLOCK_SIZE, scale)

            bytes_read = 2 * batch * context * KV_HEADS * HEAD_DIM * k.element_size()
            for impl, fn in (("triton", triton_kernel), ("gather_sdpa", gather_sdpa)):
                us = graph_time_us(fn, calls=1, reps=30, flush_l2=True)
                rows.append({"bench": "paged_attention", "impl": impl, "batch": batch, "policy": "", "union": 0.0,
                             "context": context, "time_us": us, "bytes_read": bytes_read,
                             "gbps": bytes_read / (us * 1e-6) / 1e9})
            del q, k, v, tables, lens, gather, mask
            torch.cuda.empty_cache()
    for batch in BATCHES:
        q, k, v, tables, lens = _case(batch, 1024, device, table_keys=PADDED_TABLE_KEYS)
        us = graph_time_us(lambda: paged_decode_attention(q, k, v, tables, lens, BLOCK_SIZE, scale), calls=1, reps=30,
                           flush_l2=True)
        bytes_read = 2 * batch * 1024 * KV_HEADS * HEAD_DIM * k.element_size()
        rows.append({"bench": "paged_attention", "impl": "triton", "batch": batch, "policy": "", "union": 0.0,
                     "context": 1024, "table_keys": PADDED_TABLE_KEYS, "time_us": us, "bytes_read": bytes_read,
                     "gbps": bytes_read / (us * 1e-6) / 1e9})
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    args = p.parse_args(argv)
    require_cuda(p, args.device)
    rows = bench_paged_attention(args.device)
    print(f"{'impl':12s} {'batch':>5s} {'context':>7s} {'table':>7s} {'time_us':>9s} {'MB read':>8s} {'GB/s':>7s}")
    for r in rows:
        print(f"{r['impl']:12s} {r['batch']:5d} {r['context']:7d} {r.get('table_keys', r['context']):7d} "
              f"{r['time_us']:9.1f} {r['bytes_read'] / 1e6:8.1f} {r['gbps']:7.0f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
