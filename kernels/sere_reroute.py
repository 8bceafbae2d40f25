"""SERE re-routing of one MoE layer's decode batch in one launch (Triton), beside its reference.

The reference is a handful of small device ops (a primary mask, a masked max over a similarity
matrix, a where); at 48 layers a step they cost more in launches than in work. The kernel does
the primary-set union (a histogram), the most-similar lookup and the protection / threshold test
in one launch of one program per token. It reads nothing back to the host and gives
bit-identical ids (ties pick the lowest id, as torch's max does).
"""
from __future__ import annotations

import torch

from .dependent_launch import launch_options, wait_for_inputs

import triton  # after zipmoe.kernels (the package) chose the interpreter on CPU-only machines
import triton.language as tl


def sere_reroute_reference(ids: torch.Tensor, similarity: torch.Tensor, protect: torch.Tensor,
                           opt_out: torch.Tensor | None, primary_k: int, threshold: float) -> torch.Tensor:
    """ids [T, K] top-K sorted by score; similarity [E, E] float32; protect [E] bool; opt_out [T] bool.

    The batch's primary set P = every token's first `primary_k` experts. A secondary slot holding e
    keeps e if e is in P or protected; otherwise it moves to the most similar p in P when
    similarity[e, p] >= threshold. Tokens that opted out keep their ids.
    """
    k1 = primary_k
    E = similarity.shape[-1]
    primary = torch.zeros(E, dtype=torch.bool, device=ids.device)
    primary.index_fill_(0, ids[:, :k1].reshape(-1), True)  # a scalar fill: capturable in a CUDA graph
    sim = similarity.masked_fill(~primary[None, :], float("-inf"))
    best_sim, best = sim.max(dim=1)
    secondary = ids[:, k1:]
    move = ~primary[secondary] & ~protect[secondary] & (best_sim[secondary] >= threshold)
    if opt_out is not None:
        move &= ~opt_out[:, None]
    out = ids.clone()
    out[:, k1:] = torch.where(move, best[secondary], secondary)
    return out


@triton.jit
def _sere_kernel(ids_ptr, sim_ptr, protect_ptr, opt_out_ptr, out_ptr, T, E, threshold,
                 K: tl.constexpr, K1: tl.constexpr, HAS_OPT_OUT: tl.constexpr,
                 BLOCK_T: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr, P_PAD: tl.constexpr,
                 PDL: tl.constexpr):
    wait_for_inputs(PDL)
    # The batch's primary set, rebuilt by every program so that none waits on another: one
    # histogram over all tokens' first K1 ids (a few hundred at most). Padding lanes repeat token
    # 0's first id, which is always a primary, so they add nothing.
    p = tl.arange(0, P_PAD)
    real = p < T * K1
    primary_ids = tl.load(ids_ptr + (p // K1) * K + p % K1, mask=real, other=0).to(tl.int32)
    primary_ids = tl.where(real, primary_ids, tl.load(ids_ptr).to(tl.int32))
    experts = tl.arange(0, E_PAD)
    primary = (tl.histogram(primary_ids, E_PAD) > 0) & (experts < E)

    # This program's BLOCK_T tokens: each slot's most similar primary, from the slot's similarity row.
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, K_PAD)
    in_range = (rows[:, None] < T) & (cols[None, :] < K)
    offs = rows[:, None] * K + cols[None, :]
    ids = tl.load(ids_ptr + offs, mask=in_range, other=0)
    flat = tl.reshape(ids, [BLOCK_T * K_PAD]).to(tl.int32)
    sim = tl.load(sim_ptr + flat[:, None].to(tl.int64) * E + experts[None, :],
                  mask=(experts[None, :] < E), other=float("-inf"))
    sim = tl.where(primary[None, :], sim, float("-inf"))
    best_sim = tl.max(sim, axis=1)
    best = tl.argmax(sim, axis=1, tie_break_left=True)
    is_primary = tl.max(((flat[:, None] == experts[None, :]) & primary[None, :]).to(tl.int32), axis=1)
    protected = tl.load(protect_ptr + flat).to(tl.int32)
    move = (is_primary == 0) & (protected == 0) & (best_sim >= threshold)
    move = tl.reshape(move, [BLOCK_T, K_PAD]) & (cols[None, :] >= K1)
    if HAS_OPT_OUT:
        kept = tl.load(opt_out_ptr + rows, mask=rows < T, other=0).to(tl.int32)
        move = move & (kept[:, None] == 0)
    new = tl.where(move, tl.reshape(best, [BLOCK_T, K_PAD]).to(ids.dtype), ids)
    tl.store(out_ptr + offs, new, mask=in_range)


# Tokens per program and warps: one token per program spreads a decode batch over as many SMs as
# it has tokens, each reading its K similarity rows (K x E x 4 bytes) once. The benchmark's
# `sere_kernel` rows time other shapes too (bench_kernels --parts sere): on the H200 (2026-12-02)
# four warps were the fastest at 16, 64 and 128 tokens (1.9 / 1.9 / 2.3 us against 2.2 / 2.2 / 2.4
# with two), more tokens per program slower (7.3-7.7 us at 16).
BLOCK_T, NUM_WARPS = 1, 4


def launch_sere(ids: torch.Tensor, similarity: torch.Tensor, protect: torch.Tensor, opt_out: torch.Tensor | None,
                primary_k: int, threshold: float, block_t: int = BLOCK_T, num_warps: int = NUM_WARPS) -> torch.Tensor:
    """`sere_reroute` with the launch shape given (the benchmark compares shapes)."""
    T, K = ids.shape
    E = similarity.shape[-1]
    if not 1 <= primary_k <= K:
        raise ValueError(f"primary_k must be in [1, {K}], got {primary_k}")
    ids = ids.contiguous()
    out = torch.empty_like(ids)
    if T == 0:
        return out
    _sere_kernel[(triton.cdiv(T, block_t),)](
        ids, similarity.contiguous(), protect.contiguous(), opt_out if opt_out is not None else ids, out,
        T, E, float(threshold), K=K, K1=primary_k, HAS_OPT_OUT=opt_out is not None,
        BLOCK_T=block_t, K_PAD=triton.next_power_of_2(K), E_PAD=triton.next_power_of_2(E),
        P_PAD=triton.next_power_of_2(T * primary_k), num_warps=num_warps, **launch_options(ids.device))
    return out


@torch.library.custom_op("zipmoe::sere_reroute", mutates_args=())
def sere_reroute(ids: torch.Tensor, similarity: torch.Tensor, protect: torch.Tensor,
                 opt_out: torch.Tensor | None, primary_k: int, threshold: float) -> torch.Tensor:
    """Same contract and result as `sere_reroute_reference`; one launch, no host sync."""
    return launch_sere(ids, similarity, protect, opt_out, primary_k, threshold)


@sere_reroute.register_fake
def _(ids, similarity, protect, opt_out, primary_k, threshold):
    return torch.empty_like(ids)
