"""OEA re-routing of one MoE layer's decode batch in one launch (Triton), beside its reference.

OEA (arXiv 2511.02237): each token keeps its top-k0 experts; its other K - k0 slots may only take
experts the batch already uses (the union of every token's top-k0), best router score first, and
the weights are the router's probabilities of the chosen experts, renormalised. The reference is
about fifteen small device ops (a union, a masked top-k, gathers, a renormalisation); at 48 layers a
step they cost more in launches than in work (OEA's batch-1 step was 5.6 ms against topk's 4.2).
The kernel does it in one launch with no read-back: each program rebuilds the union from every
token's first k0 ids, then picks its tokens' fills by repeated argmax (ties pick the lowest id,
as in the SERE kernel). Ids are identical to the reference's wherever the router's scores do not
tie; weights agree to float32 rounding (the sum runs in another order) before the cast.
"""
from __future__ import annotations

import torch

from .dependent_launch import launch_options, wait_for_inputs

import triton  # after zipmoe.kernels (the package) chose the interpreter on CPU-only machines
import triton.language as tl


def oea_reroute_reference(probs: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                          opt_out: torch.Tensor | None, k0: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """probs [T, E] float32 router softmax; ids/weights [T, K] top-K sorted by score; opt_out [T] bool.

    Returns new (ids, weights). A slot that finds no candidate (the union holds fewer than K - k0
    experts the token does not already have) points at the token's first expert with weight 0.
    Tokens that opted out keep their ids and weights.
    """
    K = ids.shape[1]
    E = probs.shape[1]
    union = torch.zeros(E, dtype=torch.bool, device=ids.device)
    union.index_fill_(0, ids[:, :k0].reshape(-1), True)  # a scalar fill: capturable in a CUDA graph
    # Candidates for the other slots: experts in the union, not already among the token's top-k0.
    allowed = union[None, :].expand(ids.shape[0], E).clone()
    allowed.scatter_(1, ids[:, :k0], False)
    scores = probs.masked_fill(~allowed, -1.0)
    fill_p, fill = scores.topk(K - k0, dim=1)
    empty = fill_p < 0  # fewer candidates than slots: the slot keeps weight 0
    new_ids = torch.cat([ids[:, :k0], torch.where(empty, ids[:, :1], fill)], dim=1)
    new_w = torch.cat([probs.gather(1, ids[:, :k0]), fill_p.clamp(min=0)], dim=1)
    if normalize:
        new_w = new_w / new_w.sum(dim=1, keepdim=True)
    new_w = new_w.to(weights.dtype)
    if opt_out is not None:
        keep = opt_out[:, None]
        new_ids, new_w = torch.where(keep, ids, new_ids), torch.where(keep, weights, new_w)
    return new_ids, new_w


@triton.jit
def _oea_kernel(probs_ptr, ids_ptr, weights_ptr, opt_out_ptr, out_ids_ptr, out_w_ptr, T, E,
                K: tl.constexpr, K0: tl.constexpr, NORMALIZE: tl.constexpr, HAS_OPT_OUT: tl.constexpr,
                BLOCK_T: tl.constexpr, K_PAD: tl.constexpr, K0_PAD: tl.constexpr, E_PAD: tl.constexpr,
                CHUNK_T: tl.constexpr, PDL: tl.constexpr):
    wait_for_inputs(PDL)
    experts = tl.arange(0, E_PAD)
    # The union of every token's top-k0, rebuilt by each program (no cross-program sync).
    union = tl.zeros([E_PAD], dtype=tl.int32)
    chunk_rows = tl.arange(0, CHUNK_T)
    k0_cols = tl.arange(0, K0_PAD)
    for t0 in range(0, T, CHUNK_T):
        r = t0 + chunk_rows
        ok = (r[:, None] < T) & (k0_cols[None, :] < K0)
        e = tl.load(ids_ptr + r[:, None] * K + k0_cols[None, :], mask=ok, other=-1).to(tl.int32)
        e = tl.reshape(e, [CHUNK_T * K0_PAD])
        union = tl.maximum(union, tl.max((e[:, None] == experts[None, :]).to(tl.int32), axis=0))
    union = union & (experts < E)

    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < T
    cols = tl.arange(0, K_PAD)
    tile_ok = row_ok[:, None] & (cols[None, :] < K)
    probs = tl.load(probs_ptr + rows[:, None].to(tl.int64) * E + experts[None, :],
                    mask=row_ok[:, None] & (experts[None, :] < E), other=0.0)
    ids = tl.load(ids_ptr + rows[:, None] * K + cols[None, :], mask=tile_ok, other=0)
    new_ids = ids  # slots < k0 keep their expert
    new_w = tl.zeros([BLOCK_T, K_PAD], dtype=tl.float32)
    allowed = tl.zeros([BLOCK_T, E_PAD], dtype=tl.int32) + union[None, :]
    first = tl.load(ids_ptr + rows * K, mask=row_ok, other=0)
    for j in tl.static_range(K0):  # the kept top-k0: their probabilities, and out of the candidates
        e = tl.load(ids_ptr + rows * K + j, mask=row_ok, other=0)
        hit = experts[None, :] == e[:, None].to(tl.int32)
        p = tl.sum(tl.where(hit, probs, 0.0), axis=1)  # one nonzero term: exact
        allowed = tl.where(hit, 0, allowed)
        new_w = tl.where(cols[None, :] == j, p[:, None], new_w)
    scores = tl.where(allowed != 0, probs, -1.0)
    for j in tl.static_range(K0, K):  # the fills, best first
        best_p = tl.max(scores, axis=1)
        best = tl.argmax(scores, axis=1, tie_break_left=True)
        scores = tl.where(experts[None, :] == best[:, None], float("-inf"), scores)
        empty = best_p < 0
        slot = tl.where(empty, first, best.to(first.dtype))
        new_ids = tl.where(cols[None, :] == j, slot[:, None], new_ids)
        new_w = tl.where(cols[None, :] == j, tl.where(empty, 0.0, best_p)[:, None], new_w)
    if NORMALIZE:
        total = tl.sum(new_w, axis=1)
        new_w = new_w / tl.where(total > 0, total, 1.0)[:, None]  # rows past T: 0, not 0 / 0
    new_w = new_w.to(out_w_ptr.dtype.element_ty)
    if HAS_OPT_OUT:
        keep = tl.load(opt_out_ptr + rows, mask=row_ok, other=0) != 0
        old_w = tl.load(weights_ptr + rows[:, None] * K + cols[None, :], mask=tile_ok, other=0.0)
        new_w = tl.where(keep[:, None], old_w, new_w)
        new_ids = tl.where(keep[:, None], ids, new_ids)
    tl.store(out_ids_ptr + rows[:, None] * K + cols[None, :], new_ids, mask=tile_ok)
    tl.store(out_w_ptr + rows[:, None] * K + cols[None, :], new_w, mask=tile_ok)


@torch.library.custom_op("zipmoe::oea_reroute", mutates_args=())
def oea_reroute(probs: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, opt_out: torch.Tensor | None,
                k0: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `oea_reroute_reference`; one launch, no host sync. Weights are computed in
    float32 and rounded once to `weights.dtype`."""
    T, K = ids.shape
    E = probs.shape[1]
    ids, weights = ids.contiguous(), weights.contiguous()
    out_ids, out_w = torch.empty_like(ids), torch.empty_like(weights)
    block_t = 16
    _oea_kernel[(triton.cdiv(T, block_t),)](
        probs.contiguous(), ids, weights, opt_out if opt_out is not None else ids, out_ids, out_w, T, E,
        K=K, K0=k0, NORMALIZE=normalize, HAS_OPT_OUT=opt_out is not None, BLOCK_T=block_t,
        K_PAD=triton.next_power_of_2(K), K0_PAD=triton.next_power_of_2(k0), E_PAD=triton.next_power_of_2(E),
        CHUNK_T=max(1, 64 // triton.next_power_of_2(k0)), num_warps=4, **launch_options(ids.device))
    return out_ids, out_w


@oea_reroute.register_fake
def _(probs, ids, weights, opt_out, k0, normalize):
    return torch.empty_like(ids), torch.empty_like(weights)
