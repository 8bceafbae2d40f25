"""SERE re-routing of one MoE layer's decode batch in one launch (Triton), beside its reference.

The reference is a handful of small device ops (a primary mask, a masked max over a similarity
matrix, a where); at 48 layers a step they cost more in launches than in work. The kernel does
the primary-set union, the most-similar lookup and the protection / threshold test in one
launch, reads nothing back to the host, and gives bit-identical ids (ties pick the lowest id,
as torch's max does).
"""
from __future__ import annotations

import torch

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
                 BLOCK_T: tl.constexpr, K_PAD: tl.constexpr, K1_PAD: tl.constexpr, E_PAD: tl.constexpr,
                 CHUNK_T: tl.constexpr):
    experts = tl.arange(0, E_PAD)
    # Every program rebuilds the (small) primary set from all tokens rather than syncing programs;
    # it reads only the primary columns (K1 of K).
    primary = tl.zeros([E_PAD], dtype=tl.int32)
    chunk_rows = tl.arange(0, CHUNK_T)
    primary_cols = tl.arange(0, K1_PAD)
    for t0 in range(0, T, CHUNK_T):
        rows = t0 + chunk_rows
        ok = (rows[:, None] < T) & (primary_cols[None, :] < K1)
        e = tl.load(ids_ptr + rows[:, None] * K + primary_cols[None, :], mask=ok, other=-1).to(tl.int32)
        e = tl.reshape(e, [CHUNK_T * K1_PAD])
        primary = tl.maximum(primary, tl.max((e[:, None] == experts[None, :]).to(tl.int32), axis=0))
    primary = primary & (experts < E)

    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, K_PAD)
    in_range = (rows[:, None] < T) & (cols[None, :] < K)
    offs = rows[:, None] * K + cols[None, :]
    ids = tl.load(ids_ptr + offs, mask=in_range, other=0)
    flat = tl.reshape(ids, [BLOCK_T * K_PAD]).to(tl.int32)
    sim = tl.load(sim_ptr + flat[:, None].to(tl.int64) * E + experts[None, :],
                  mask=(experts[None, :] < E), other=float("-inf"))
    sim = tl.where(primary[None, :] != 0, sim, float("-inf"))
    best_sim = tl.max(sim, axis=1)
    best = tl.argmax(sim, axis=1, tie_break_left=True)
    is_primary = tl.max(((flat[:, None] == experts[None, :]) & (primary[None, :] != 0)).to(tl.int32), axis=1)
    protected = tl.load(protect_ptr + flat).to(tl.int32)
    move = (is_primary == 0) & (protected == 0) & (best_sim >= threshold)
    move = tl.reshape(move, [BLOCK_T, K_PAD]) & (cols[None, :] >= K1)
    if HAS_OPT_OUT:
        kept = tl.load(opt_out_ptr + rows, mask=rows < T, other=0).to(tl.int32)
        move = move & (kept[:, None] == 0)
    new = tl.where(move, tl.reshape(best, [BLOCK_T, K_PAD]).to(ids.dtype), ids)
    tl.store(out_ptr + offs, new, mask=in_range)


@torch.library.custom_op("zipmoe::sere_reroute", mutates_args=())
def sere_reroute(ids: torch.Tensor, similarity: torch.Tensor, protect: torch.Tensor,
                 opt_out: torch.Tensor | None, primary_k: int, threshold: float) -> torch.Tensor:
    """Same contract and result as `sere_reroute_reference`; one launch, no host sync."""
    T, K = ids.shape
    E = similarity.shape[-1]
    ids = ids.contiguous()
    out = torch.empty_like(ids)
    block_t = 16
    _sere_kernel[(triton.cdiv(T, block_t),)](
        ids, similarity.contiguous(), protect.contiguous(), opt_out if opt_out is not None else ids, out,
        T, E, float(threshold), K=K, K1=primary_k, HAS_OPT_OUT=opt_out is not None,
        BLOCK_T=block_t, K_PAD=triton.next_power_of_2(K), K1_PAD=triton.next_power_of_2(primary_k),
        E_PAD=triton.next_power_of_2(E), CHUNK_T=max(1, 64 // triton.next_power_of_2(primary_k)),
        num_warps=4)
    return out


@sere_reroute.register_fake
def _(ids, similarity, protect, opt_out, primary_k, threshold):
    return torch.empty_like(ids)
