"""The MoE router in one launch (Triton): its GEMM, softmax, top-K and renormalisation, and for a
single token the residual add and RMSNorm in front of it; beside their PyTorch references.

Called by `engine/model.py` after each MoE layer's attention output projection: `add_norm_router`
takes the residual stream and the projection's output, and gives the new residual stream, the
experts' normed input (for `fused_moe`) and the routing (for the routing policy). At one token that
is one launch where it was two (`layer_ops.add_rms_norm`, then `router`); each program computes the
row's norm itself (8 kB from L2 at the 30B shape) instead of waiting for a kernel that did.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .arrivals import arrival_counters, last_to_arrive, split_width, sum_splits
from .dependent_launch import launch_options, wait_for_inputs
from .layer_ops import (add_rms_norm, add_rms_norm_reference, inverse_rms, residual_sum, router_reference, scaled,
                        store_softmax_topk, topk_softmax)

import triton  # after zipmoe.kernels (the package) chose the interpreter on CPU-only machines
import triton.language as tl

ROUTER_BLOCK_T = 16  # tokens per program (tl.dot's smallest tile)
ROUTER_BLOCK_E = 16  # experts per program
ROUTER_BLOCK_H = 128  # hidden columns per loop iteration
# Decode reads the gate (128 x 2048 bf16: 512 kB) from few token tiles, and one program's loads
# wait ~1 us each: session 18's profile gave 11 us a layer to 8 programs walking H in 16 steps.
# So H is split too, until about ROUTER_PROGRAMS programs each read a few kB at once; the splits'
# float32 partial logits are summed by the last program of the tile, at most ROUTER_MAX_SPLIT
# loads from L2.
ROUTER_PROGRAMS = 64
ROUTER_MAX_SPLIT = 8
ROUTER_GROUPS = 16  # arrival counters, one per token tile: `fused_router` serves up to 256 tokens
# `router` takes the one launch up to this many tokens and cuBLAS's GEMM then `layer_ops.topk_softmax`.
# Session 19 (`bench_kernels --parts router`, per layer): 7.7 / 8.1 us against 8.0 / 8.2 at 1 and
# 16 tokens, but 9.2 / 11.9 against 8.5 / 8.5 at 64 and 128.
ROUTER_MAX_T = 16


def router_split(T: int, H: int, E: int) -> int:
    """How many programs share one (token tile, expert block)'s hidden dimension."""
    tiles = triton.cdiv(T, ROUTER_BLOCK_T) * triton.cdiv(E, ROUTER_BLOCK_E)
    return max(1, min(ROUTER_PROGRAMS // tiles, ROUTER_MAX_SPLIT, triton.cdiv(H, ROUTER_BLOCK_H)))


@triton.jit
def _router_kernel(x_ptr, gate_ptr, partial_ptr, arrivals_ptr, probs_ptr, ids_ptr, w_ptr, h_ptr, delta_ptr, norm_ptr,
                   h_out_ptr, T, H, E, H_PER_SPLIT, eps, K: tl.constexpr, E_PAD: tl.constexpr, K_PAD: tl.constexpr,
                   NORMALIZE: tl.constexpr, MAX_SPLIT: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
                   BLOCK_H: tl.constexpr, H_PAD: tl.constexpr, ADD_NORM: tl.constexpr, DOT_PRECISION: tl.constexpr,
                   PDL: tl.constexpr):
    wait_for_inputs(PDL)
    # Program (tile, expert block, split) sums BLOCK_T x BLOCK_E logits over its H_PER_SPLIT hidden
    # columns in float32; the last program of a token tile to check in (`kernels/arrivals.py`) sums
    # the splits, rounds to x's dtype as F.linear rounds its logits, and does topk_softmax's work
    # on them. One launch, where the GEMM and the top-K were two.
    # ADD_NORM (one token): x is not read but made, x = rms_norm(h + delta) as add_rms_norm makes
    # it; every program takes the row's statistics, and the first expert block's programs store
    # their columns of h + delta (h_out) and of x, which the experts read next.
    tile, eb, split, split_count = tl.program_id(0), tl.program_id(1), tl.program_id(2), tl.num_programs(2)
    rows = (tile * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    experts = eb * BLOCK_E + tl.arange(0, BLOCK_E)
    if ADD_NORM:
        row = tl.arange(0, H_PAD)
        inv = inverse_rms(residual_sum(h_ptr, delta_ptr, row, row < H, H, 1), H, eps)
    acc = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.float32)
    for h0 in range(split * H_PER_SPLIT, tl.minimum((split + 1) * H_PER_SPLIT, H), BLOCK_H):
        h = h0 + tl.arange(0, BLOCK_H)
        # The gate first: its loads need nothing computed here, and go out before the stores below.
        gs = tl.load(gate_ptr + experts[:, None] * H + h[None, :], mask=(experts[:, None] < E) & (h[None, :] < H),
                     other=0.0)
        if ADD_NORM:
            res = residual_sum(h_ptr, delta_ptr, h, h < H, H, 1)
            x = scaled(res, inv, tl.load(norm_ptr + h, mask=h < H, other=0.0))
            if eb == 0:
                tl.store(h_out_ptr + h, res, mask=h < H)
                tl.store(x_ptr + h, x, mask=h < H)
            xs = tl.where(rows[:, None] == 0, x.to(tl.float32)[None, :], 0.0).to(x.dtype)
        else:
            xs = tl.load(x_ptr + rows[:, None] * H + h[None, :], mask=(rows[:, None] < T) & (h[None, :] < H),
                         other=0.0)
        acc += tl.dot(xs, tl.trans(gs), input_precision=DOT_PRECISION)
    tl.store(partial_ptr + (split * T + rows[:, None]) * E + experts[None, :], acc,
             mask=(rows[:, None] < T) & (experts[None, :] < E))
    if last_to_arrive(arrivals_ptr + tile, tl.num_programs(1) * split_count):
        e = tl.arange(0, E_PAD)
        logit = sum_splits(partial_ptr, rows, e, T, E, split_count, (rows[:, None] < T) & (e[None, :] < E), MAX_SPLIT)
        logit = logit.to(x_ptr.dtype.element_ty).to(tl.float32)
        store_softmax_topk(logit, rows, T, E, probs_ptr, ids_ptr, w_ptr, BLOCK_T, K, E_PAD, K_PAD, NORMALIZE)


def _launch(x: torch.Tensor, gate: torch.Tensor, top_k: int, normalize: bool, norm_inputs=None):
    """(probs, ids, weights) of the router kernel over x [T, H]; norm_inputs (h, delta, norm weight,
    h_out, eps): one token, x made by the kernel (ADD_NORM) into the given x."""
    T, H = x.shape
    E = gate.shape[0]
    if triton.cdiv(T, ROUTER_BLOCK_T) > ROUTER_GROUPS:
        raise ValueError(f"fused_router serves at most {ROUTER_GROUPS * ROUTER_BLOCK_T} tokens, got {T}")
    probs = torch.empty(T, E, dtype=torch.float32, device=x.device)
    ids = torch.empty(T, top_k, dtype=torch.int64, device=x.device)
    weights = torch.empty(T, top_k, dtype=x.dtype, device=x.device)
    if T:
        split = router_split(T, H, E)
        partial = torch.empty(split, T, E, dtype=torch.float32, device=x.device)
        grid = (triton.cdiv(T, ROUTER_BLOCK_T), triton.cdiv(E, ROUTER_BLOCK_E), split)
        arrivals = arrival_counters("router", x.device, ROUTER_GROUPS)
        h, delta, norm, h_out, eps = norm_inputs or (x, x, x, x, 0.0)
        _router_kernel[grid](x, gate.contiguous(), partial, arrivals, probs, ids, weights, h, delta, norm, h_out,
                             T, H, E, split_width(H, split, ROUTER_BLOCK_H), eps, K=top_k,
                             E_PAD=triton.next_power_of_2(E), K_PAD=triton.next_power_of_2(top_k),
                             NORMALIZE=normalize, MAX_SPLIT=ROUTER_MAX_SPLIT, BLOCK_T=ROUTER_BLOCK_T,
                             BLOCK_E=ROUTER_BLOCK_E, BLOCK_H=ROUTER_BLOCK_H, H_PAD=triton.next_power_of_2(H),
                             ADD_NORM=norm_inputs is not None,
                             # float32 (tests, the CPU reference's dtype) as F.linear computes it, not in TF32
                             DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32", num_warps=4,
                             **launch_options(x.device))
    return probs, ids, weights


def fused_router(x: torch.Tensor, gate: torch.Tensor, top_k: int,
                 normalize: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`router_reference`'s contract in one launch, up to ROUTER_GROUPS token tiles (ties: the
    lowest expert id first). `router` calls it where it was measured faster."""
    return _launch(x.contiguous(), gate, top_k, normalize)


@torch.library.custom_op("zipmoe::fused_add_norm_router", mutates_args=())
def fused_add_norm_router(h: torch.Tensor, delta: torch.Tensor, norm: torch.Tensor, gate: torch.Tensor, top_k: int,
                          normalize: bool, eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                torch.Tensor, torch.Tensor]:
    """`add_norm_router_reference`'s contract in one launch, for one token."""
    if h.shape[0] != 1 or delta.shape != h.shape:
        raise ValueError(f"fused_add_norm_router serves one token's row, got h {tuple(h.shape)}, delta "
                         f"{tuple(delta.shape)}")
    h_out, x = torch.empty_like(h), torch.empty_like(h)
    return (h_out, x) + _launch(x, gate, top_k, normalize, (h.contiguous(), delta.contiguous(), norm, h_out, eps))


@fused_add_norm_router.register_fake
def _(h, delta, norm, gate, top_k, normalize, eps):
    T, E = h.shape[0], gate.shape[0]
    return (torch.empty_like(h), torch.empty_like(h), h.new_empty(T, E, dtype=torch.float32),
            h.new_empty(T, top_k, dtype=torch.int64), h.new_empty(T, top_k))


@torch.library.custom_op("zipmoe::router", mutates_args=())
def router(x: torch.Tensor, gate: torch.Tensor, top_k: int,
           normalize: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Same contract as `router_reference`: `fused_router` up to ROUTER_MAX_T tokens, the GEMM then
    `layer_ops.topk_softmax`."""
    if x.shape[0] > ROUTER_MAX_T:
        return topk_softmax(F.linear(x, gate), top_k, normalize, x.dtype)
    return fused_router(x, gate, top_k, normalize)


@router.register_fake
def _(x, gate, top_k, normalize):
    T, E = x.shape[0], gate.shape[0]
    return (x.new_empty(T, E, dtype=torch.float32), x.new_empty(T, top_k, dtype=torch.int64),
            x.new_empty(T, top_k))


def add_norm_router_reference(h: torch.Tensor, delta: torch.Tensor, norm: torch.Tensor, gate: torch.Tensor,
                              top_k: int, normalize: bool, eps: float):
    """After a layer's attention: (h + delta, x = rms_norm(h + delta), then the router on x: probs,
    ids, weights). h, delta [T, H] (delta: the attention's output projection)."""
    h, x = add_rms_norm_reference(h, delta, norm, eps)
    return (h, x) + router_reference(x, gate, top_k, normalize)


def add_norm_router(h: torch.Tensor, delta: torch.Tensor, norm: torch.Tensor, gate: torch.Tensor, top_k: int,
                    normalize: bool, eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                                          torch.Tensor]:
    """Same contract as `add_norm_router_reference`: one launch for one token (each program reads the
    token's whole row for its statistics), else `layer_ops.add_rms_norm` then `router` above (chosen
    here, not inside an op: no second dispatch)."""
    if h.shape[0] == 1:
        return fused_add_norm_router(h, delta, norm, gate, top_k, normalize, eps)
    h, x = add_rms_norm(h, delta, norm, eps)
    return (h, x) + router(x, gate, top_k, normalize)
