"""The attention's output projection, the residual add and the MoE's input RMSNorm in one launch, up
to 16 tokens, beside its PyTorch reference: a candidate the engine does not take yet.

At decode batch sizes the o projection is a GEMV over the layer's largest dense weight (Qwen3-30B-
A3B: 2048 x 4096 bf16, 16.8 MB, 4.0 us at an H200's copy speed). The engine runs cuBLAS's split-K
GEMM, its reduce and `layer_ops.add_rms_norm`: three launches, 11.3 us a layer at batch 1 (session
19's `bench_kernels --parts out_proj`). Session 19 also measured a first one-launch version, 128
programs of 16 output columns each reading the whole input width: 13.3 us, slower at every size,
so it was removed. This one splits the input width too, as `qkv_norm_rope` (even with cuBLAS at one
token) does: a program per (block of OUT_BLOCK_N output columns, split of the input width), 256 at
the 30B shape, each reading 64 kB; three steps, each closed by `kernels/arrivals.last_to_arrive`:
  1. every program stores its float32 share of its columns;
  2. the last split of a column block to arrive sums the shares, rounds them to the model dtype (as
     F.linear rounds), adds the residual (rounded as `add_rms_norm` rounds), stores those columns
     of h and their rows' float32 sum of squares;
  3. the last column block to arrive sums the squares and writes the normed rows.
The engine keeps its three launches until `bench_kernels --parts out_proj` shows this faster
(`engine/model.py` is then a one-line change). Tested in Triton's interpreter; the CUDA tests
(`tests/test_kernel_out_proj_norm.py`, 30B shape, in a CUDA graph) have not run yet.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .arrivals import arrival_counters, last_to_arrive, split_width, sum_splits
from .layer_ops import add_rms_norm_reference

import triton  # after zipmoe.kernels (the package) chose the interpreter on CPU-only machines
import triton.language as tl

OUT_BLOCK_T = 16  # token rows of a program's tile (tl.dot's smallest); also the most it serves
OUT_BLOCK_N = 128  # output columns per program
OUT_BLOCK_K = 128  # input columns per loop iteration
OUT_MAX_SPLIT = 16  # splits of the input width: 16 column blocks x 16 = 256 programs at the 30B shape
OUT_MAX_BLOCKS = 64  # column blocks one launch serves (8,192 columns): one arrival counter each, plus one


def out_proj_add_rms_norm_reference(h: torch.Tensor, attn: torch.Tensor, weight: torch.Tensor,
                                    norm_weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(h + attn @ weight.T, its rms_norm): the residual stream after attention and the MoE's input."""
    return add_rms_norm_reference(h, F.linear(attn, weight), norm_weight, eps)


@triton.jit
def _out_proj_norm_kernel(a_ptr, w_ptr, h_ptr, nw_ptr, partial_ptr, squares_ptr, arrivals_ptr, h_out_ptr,
                          x_out_ptr, T, N, K, K_PER_SPLIT, eps, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr, MAX_SPLIT: tl.constexpr, MAX_BLOCKS: tl.constexpr,
                          DOT_PRECISION: tl.constexpr):
    # arrivals: one counter per column block (step 2), then the launch's own at MAX_BLOCKS (step 3).
    block, split, split_count = tl.program_id(0), tl.program_id(1), tl.num_programs(1)
    block_count = tl.num_programs(0)
    rows = tl.arange(0, BLOCK_T).to(tl.int64)
    cols = block * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    acc = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
    for k0 in range(split * K_PER_SPLIT, tl.minimum((split + 1) * K_PER_SPLIT, K), BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(a_ptr + rows[:, None] * K + k[None, :], mask=(rows[:, None] < T) & (k[None, :] < K), other=0.0)
        w = tl.load(w_ptr + cols[:, None].to(tl.int64) * K + k[None, :], mask=col_ok[:, None] & (k[None, :] < K),
                    other=0.0)
        acc += tl.dot(a, tl.trans(w), input_precision=DOT_PRECISION)
    ok = (rows[:, None] < T) & col_ok[None, :]
    tl.store(partial_ptr + (split * T + rows[:, None]) * N + cols[None, :], acc, mask=ok)
    if last_to_arrive(arrivals_ptr + block, split_count):
        o = sum_splits(partial_ptr, rows, cols, T, N, split_count, ok, MAX_SPLIT)
        at = rows[:, None] * N + cols[None, :]
        h = tl.load(h_ptr + at, mask=ok, other=0.0)
        dtype = h.dtype
        # F.linear's output rounded to the model dtype, then the residual add rounded as add_rms_norm's.
        h = (h.to(tl.float32) + o.to(dtype).to(tl.float32)).to(dtype)
        tl.store(h_out_ptr + at, h, mask=ok)
        h32 = h.to(tl.float32)
        tl.store(squares_ptr + block * T + rows, tl.sum(h32 * h32, axis=1), mask=rows < T)
        if last_to_arrive(arrivals_ptr + MAX_BLOCKS, block_count):
            # Every row's sum of squares is known now, so the rows are normed a column block at a
            # time ([BLOCK_T, BLOCK_N] tiles, as the steps before), not whole rows in registers.
            sq = tl.zeros([BLOCK_T], dtype=tl.float32)
            for b in range(0, block_count):
                sq += tl.load(squares_ptr + b * T + rows, mask=rows < T, other=0.0, cache_modifier=".cg")
            inv = tl.rsqrt(sq / N + eps)[:, None]
            for c0 in range(0, N, BLOCK_N):
                c = c0 + tl.arange(0, BLOCK_N)
                tile_ok = (rows[:, None] < T) & (c[None, :] < N)
                at = rows[:, None] * N + c[None, :]
                # .cg: the other column blocks' h is in L2, never in this SM's L1.
                hc = tl.load(h_out_ptr + at, mask=tile_ok, other=0.0, cache_modifier=".cg").to(tl.float32)
                nw = tl.load(nw_ptr + c, mask=c < N, other=0.0).to(tl.float32)
                tl.store(x_out_ptr + at, (nw[None, :] * (hc * inv).to(dtype).to(tl.float32)).to(dtype), mask=tile_ok)


def fused_out_proj_add_rms_norm(h: torch.Tensor, attn: torch.Tensor, weight: torch.Tensor, norm_weight: torch.Tensor,
                                eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`out_proj_add_rms_norm_reference`'s contract (h [T, N], attn [T, K], weight [N, K]) in one
    launch, up to OUT_BLOCK_T tokens."""
    T, K = attn.shape
    N = weight.shape[0]
    if T > OUT_BLOCK_T:
        raise ValueError(f"fused_out_proj_add_rms_norm serves at most {OUT_BLOCK_T} tokens, got {T}")
    if (tuple(weight.shape) != (N, K) or tuple(h.shape) != (T, N) or tuple(norm_weight.shape) != (N,)
            or triton.cdiv(N, OUT_BLOCK_N) > OUT_MAX_BLOCKS):
        raise ValueError(f"h {tuple(h.shape)}, attn {tuple(attn.shape)}, weight {tuple(weight.shape)}, norm weight "
                         f"{tuple(norm_weight.shape)}: not [T, N], [T, K], [N, K], [N] with N at most "
                         f"{OUT_MAX_BLOCKS * OUT_BLOCK_N}")
    if len({t.device for t in (h, attn, weight, norm_weight)}) > 1:
        raise ValueError("h, attn, weight and norm weight must be on one device")
    if not h.dtype == attn.dtype == weight.dtype:
        raise ValueError(f"h, attn and weight must share a dtype, got {h.dtype}, {attn.dtype}, {weight.dtype}")
    h = h.contiguous()
    h_out, x_out = torch.empty_like(h), torch.empty_like(h)
    if T:
        blocks = triton.cdiv(N, OUT_BLOCK_N)
        split = max(1, min(OUT_MAX_SPLIT, triton.cdiv(K, OUT_BLOCK_K)))
        partial = torch.empty(split, T, N, dtype=torch.float32, device=h.device)
        squares = torch.empty(blocks, T, dtype=torch.float32, device=h.device)
        _out_proj_norm_kernel[(blocks, split)](
            attn.contiguous(), weight.contiguous(), h, norm_weight.contiguous(), partial, squares,
            arrival_counters("out_proj_norm", h.device, OUT_MAX_BLOCKS + 1), h_out, x_out, T, N, K,
            split_width(K, split, OUT_BLOCK_K), eps, BLOCK_T=OUT_BLOCK_T, BLOCK_N=OUT_BLOCK_N,
            BLOCK_K=OUT_BLOCK_K, MAX_SPLIT=OUT_MAX_SPLIT, MAX_BLOCKS=OUT_MAX_BLOCKS,
            # float32 (tests, the CPU reference's dtype) as F.linear computes it, not in TF32
            DOT_PRECISION="ieee" if h.dtype == torch.float32 else "tf32",
            num_warps=4, num_stages=2)  # 2 iterations a program at the 30B shape, as qkv_norm_rope
    return h_out, x_out
