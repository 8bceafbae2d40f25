"""One token's linear layer as a single GEMV launch (Triton), beside its PyTorch reference.

At batch 1 the attention's output projection is a GEMV over a 2048 x 4096 bf16 weight at
Qwen3-30B-A3B's shape (16.8 MB, 4.0 us at an H200's copy speed). cuBLAS runs it split over the
input width, then a second kernel sums the splits (7.0 + 1.7 us a layer, session 19's profile).
Here each program owns BLOCK_N whole output rows: its loads of the weight do not depend on one
another (the loop over the input width is unrolled, the width being a compile-time constant), so
they are all in flight at once, and no sum across programs is left for a second launch.

Called by `engine/model.py` for each layer's output projection (`ops.linear`); `linear` takes the
one launch for a single token, cuBLAS's GEMM for more.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .dependent_launch import launch_options, wait_for_inputs

import triton  # after zipmoe.kernels (the package) chose the interpreter on CPU-only machines
import triton.language as tl

# Output rows a program (512 programs at the 30B shape, about four a multiprocessor), input columns a
# step of the unrolled loop, warps a program: the fastest of nine shapes timed on the H200 (session
# 30, per layer: 6.1 us against 6.9 for 8 rows and 4 warps, 9.3-10.6 for 256-column steps, 9.5 for cuBLAS).
GEMV_BLOCK_N = 4
GEMV_BLOCK_K = 512
GEMV_WARPS = 2


def linear_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [T, K] @ weight [N, K].T in x's dtype, as F.linear."""
    return F.linear(x, weight)


@triton.jit
def gemv_rows(x_ptr, w_ptr, n, N, K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """float32 sums [BLOCK_N] of rows n of w [N, K] times x [K]. The loop over the width is unrolled
    (K is a compile-time constant), so every load of the weight is in flight at once. Also the
    output projection and the folded router rows of `folded_router.py`."""
    return gemv_rows_from(x_ptr, w_ptr, n, N, K, BLOCK_N, BLOCK_K, tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32), 0)


@triton.jit
def gemv_first_columns(w_ptr, n, N, K: tl.constexpr, WIDTH: tl.constexpr):
    """Rows n of w [N, K], their first WIDTH columns (a power of two of BLOCK_K, at most K): the
    part of `gemv_rows_from`'s weight a kernel loads ahead of its wait (`dependent_launch`)."""
    k = tl.arange(0, WIDTH)
    return tl.load(w_ptr + n[:, None].to(tl.int64) * K + k[None, :], mask=(n[:, None] < N) & (k[None, :] < K),
                   other=0.0)


@triton.jit
def gemv_first_sums(w, x_ptr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, WIDTH: tl.constexpr):
    """The [BLOCK_N, BLOCK_K] float32 sums of `gemv_first_columns`' w times x[:WIDTH], the
    accumulator `gemv_rows_from` goes on from."""
    x = tl.load(x_ptr + tl.arange(0, WIDTH)).to(tl.float32)
    return tl.sum(tl.reshape(w.to(tl.float32) * x[None, :], [BLOCK_N, WIDTH // BLOCK_K, BLOCK_K]), axis=1)


@triton.jit
def gemv_rows_from(x_ptr, w_ptr, n, N, K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, acc,
                   START: tl.constexpr):
    """`gemv_rows` from column START on, acc [BLOCK_N, BLOCK_K] holding the columns before."""
    ks = tl.arange(0, BLOCK_K)
    rows = w_ptr + n[:, None].to(tl.int64) * K
    for k0 in tl.static_range(START, K, BLOCK_K):
        k = k0 + ks
        w = tl.load(rows + k[None, :], mask=(n[:, None] < N) & (k[None, :] < K), other=0.0)
        x = tl.load(x_ptr + k, mask=k < K, other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    return tl.sum(acc, axis=1)


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, out_ptr, N, K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 PDL: tl.constexpr):
    wait_for_inputs(PDL)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    tl.store(out_ptr + n, gemv_rows(x_ptr, w_ptr, n, N, K, BLOCK_N, BLOCK_K).to(out_ptr.dtype.element_ty), mask=n < N)


@torch.library.custom_op("zipmoe::gemv", mutates_args=())
def gemv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`linear_reference` for x [1, K] in one launch."""
    if x.shape[0] != 1 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"gemv: x must be one row of weight's width {weight.shape[1]}, got {tuple(x.shape)}")
    N, K = weight.shape
    out = torch.empty(1, N, dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(N, GEMV_BLOCK_N),)](
        x.contiguous(), weight.contiguous(), out, N, K=K, BLOCK_N=GEMV_BLOCK_N,
        BLOCK_K=min(GEMV_BLOCK_K, triton.next_power_of_2(K)), num_warps=GEMV_WARPS, **launch_options(x.device))
    return out


@gemv.register_fake
def _(x, weight):
    return x.new_empty(1, weight.shape[0])


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Same contract as `linear_reference`: `gemv` for one token, cuBLAS's GEMM for more (chosen
    here, not inside an op: an eager prefill step pays no second dispatch for its GEMMs)."""
    return gemv(x, weight) if x.shape[0] == 1 else F.linear(x, weight)
