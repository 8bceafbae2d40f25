"""The attention's output projection, the residual add and the next RMSNorm in one launch, beside
its PyTorch reference.

At decode batch sizes the o projection is a GEMV over the layer's largest dense weight (Qwen3-30B-
A3B: 2048 x 4096 bf16, 16.8 MB, 4.0 us at an H200's copy speed). cuBLAS ran it as a split-K GEMM
plus its own reduce (8.7 us a layer at batch 1, session 18's profile), then `add_rms_norm` took a
third launch (2.2 us). Here programs of 16 output columns each read their rows of the weight over
the whole input width, store their slice of the projection (rounded to the model dtype, as
F.linear rounds it), and check in (`kernels/arrivals.py`); the last program to arrive holds every
column and does `add_rms_norm`'s work on whole rows. One launch where there were three, at most
OUT_MAX_T tokens (a decode step); above that cuBLAS's GEMM and `add_rms_norm`.

Called by `engine/model.py` after each layer's attention (`ops.out_proj_add_rms_norm`); the
reference is what the engine runs elsewhere, with the same signature.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .arrivals import arrival_counters, last_to_arrive
from .layer_ops import add_rms_norm, add_rms_norm_reference

import triton  # after zipmoe.kernels (the package) chose the interpreter on CPU-only machines
import triton.language as tl

OUT_BLOCK_T = 16  # token rows of a program's tile (tl.dot's smallest); also the most it serves
OUT_MAX_T = OUT_BLOCK_T
OUT_BLOCK_N = 16  # output columns per program: 2048 / 16 = 128 programs, one wave on 132 SMs
OUT_BLOCK_K = 256  # input columns per loop iteration (8 kB of weight), several in flight (num_stages)
NORM_ROWS = 4  # rows the last program norms at once ([4, 2048] float32: 32 registers a thread at 8 warps)


def out_proj_add_rms_norm_reference(h: torch.Tensor, attn: torch.Tensor, weight: torch.Tensor,
                                    norm_weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(h + attn @ weight.T, its rms_norm): the residual stream after attention and the MoE's input."""
    return add_rms_norm_reference(h, F.linear(attn, weight), norm_weight, eps)


@triton.jit
def _out_proj_norm_kernel(a_ptr, w_ptr, h_ptr, nw_ptr, o_ptr, arrivals_ptr, h_out_ptr, x_out_ptr, T, N, K, eps,
                          N_PAD: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                          NORM_ROWS: tl.constexpr, DOT_PRECISION: tl.constexpr):
    rows = tl.arange(0, BLOCK_T).to(tl.int64)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(a_ptr + rows[:, None] * K + k[None, :], mask=(rows[:, None] < T) & (k[None, :] < K), other=0.0)
        w = tl.load(w_ptr + cols[:, None].to(tl.int64) * K + k[None, :], mask=(cols[:, None] < N) & (k[None, :] < K),
                    other=0.0)
        acc += tl.dot(a, tl.trans(w), input_precision=DOT_PRECISION)
    tl.store(o_ptr + rows[:, None] * N + cols[None, :], acc.to(o_ptr.dtype.element_ty),
             mask=(rows[:, None] < T) & (cols[None, :] < N))
    if last_to_arrive(arrivals_ptr, tl.num_programs(0)):
        c = tl.arange(0, N_PAD)
        nw = tl.load(nw_ptr + c, mask=c < N, other=0.0).to(tl.float32)
        for r0 in range(0, T, NORM_ROWS):
            r = (r0 + tl.arange(0, NORM_ROWS)).to(tl.int64)
            ok = (r[:, None] < T) & (c[None, :] < N)
            at = r[:, None] * N + c[None, :]
            # .cg: the other programs' columns are in L2, never in this SM's L1.
            o = tl.load(o_ptr + at, mask=ok, other=0.0, cache_modifier=".cg").to(tl.float32)
            h = tl.load(h_ptr + at, mask=ok, other=0.0)
            h = (h.to(tl.float32) + o).to(h.dtype)  # the residual add rounds as add_rms_norm's does
            tl.store(h_out_ptr + at, h, mask=ok)
            h32 = h.to(tl.float32)
            normed = (h32 * tl.rsqrt(tl.sum(h32 * h32, axis=1) / N + eps)[:, None]).to(h.dtype)
            tl.store(x_out_ptr + at, (nw[None, :] * normed.to(tl.float32)).to(h.dtype), mask=ok)


@torch.library.custom_op("zipmoe::out_proj_add_rms_norm", mutates_args=())
def out_proj_add_rms_norm(h: torch.Tensor, attn: torch.Tensor, weight: torch.Tensor, norm_weight: torch.Tensor,
                          eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `out_proj_add_rms_norm_reference` (h [T, N], attn [T, K], weight [N, K]);
    one launch up to OUT_MAX_T tokens."""
    T, K = attn.shape
    N = weight.shape[0]
    if T > OUT_MAX_T:
        return add_rms_norm(h, F.linear(attn, weight), norm_weight, eps)
    if not h.dtype == attn.dtype == weight.dtype:
        raise ValueError(f"h, attn and weight must share a dtype, got {h.dtype}, {attn.dtype}, {weight.dtype}")
    h = h.contiguous()
    h_out, x_out = torch.empty_like(h), torch.empty_like(h)
    if T:
        projected = torch.empty(T, N, dtype=h.dtype, device=h.device)
        _out_proj_norm_kernel[(triton.cdiv(N, OUT_BLOCK_N),)](
            attn.contiguous(), weight.contiguous(), h, norm_weight, projected,
            arrival_counters("out_proj_norm", h.device, 1), h_out, x_out, T, N, K, eps,
            N_PAD=triton.next_power_of_2(N), BLOCK_T=OUT_BLOCK_T, BLOCK_N=OUT_BLOCK_N, BLOCK_K=OUT_BLOCK_K,
            NORM_ROWS=NORM_ROWS,
            # float32 (tests, the CPU reference's dtype) as F.linear computes it, not in TF32
            DOT_PRECISION="ieee" if h.dtype == torch.float32 else "tf32",
            num_warps=8, num_stages=4)  # 8 warps: the last program's [4, 2048] float32 rows in fewer registers
    return h_out, x_out


@out_proj_add_rms_norm.register_fake
def _(h, attn, weight, norm_weight, eps):
    return torch.empty_like(h), torch.empty_like(h)
