"""The routing of one decode token inside the fold's gate/up launch (`folded_router.py`), as
Triton pieces: the router's logits scaled by h's 1 / RMS (`scaled_logits`), one integer key an
expert in rank order (`rank_keys`), the top-K by K rounds of a max, block-wide for every slot
(`top_k_ids`, the routing program and SERE) or within each warp for one slot (`ranked_expert`, a
GEMM program, its weight too where that program runs the down GEMM), SERE's moves for a lone token
(`sere_moves`), the slots' weights (`routing_weights`) and the stores of the ids, weights and the down
GEMM's tiles (`store_routing`). `routed_ids` chains the block-wide ones.
"""
from __future__ import annotations

import triton  # after zipmoe.kernels (the package) chose the interpreter on CPU-only machines
import triton.language as tl


@triton.jit
def scaled_logits(logits_ptr, inv, e, E, dtype):
    """The router's logits at experts e (any shape; -inf past E): the folded sums times h's 1 / RMS,
    rounded to the model's dtype as F.linear rounds them."""
    raw = tl.load(logits_ptr + e, mask=e < E, other=0.0)
    return tl.where(e < E, (raw * inv).to(dtype).to(tl.float32), float("-inf"))


@triton.jit
def rank_keys(logit, e, PACKED: tl.constexpr):
    """(one integer key an expert, in rank order: distinct, larger ranks ahead; a key below them all).
    An expert ranks ahead of another with a larger logit, or an equal one and a lower id (the order
    of `layer_ops.store_softmax_topk`): the logit's bits made to order as signed integers above its
    id reversed in the key's 16 low bits (at most 65,536 experts; the fold takes 128). PACKED (logits
    that are bfloat16 values): the logit's 16 high bits above it, an int32 key; otherwise all 32, an
    int64 one. A NaN logit ranks ahead of every number (as torch.topk has it) and -0.0 as +0.0, so
    the ids taken are always distinct experts. K rounds that each take the largest key left rank the
    top-K: ranking every expert against every other, an [E, E] comparison, took 1,700 instructions a
    thread ahead of the first weight load in every gate/up program against 270 (sm_90)."""
    bits = tl.where(logit == logit, tl.where(logit == 0.0, 0, logit.to(tl.int32, bitcast=True)), 0x7FC00000)
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # a negative float's magnitude bits flipped
    if PACKED:
        key, lowest = (ordered & -65536) | (65535 - e), -2147483648
    else:
        key, lowest = (ordered.to(tl.int64) << 32) | (65535 - e), -9223372036854775808
    return key, lowest


@triton.jit
def top_k_ids(logit, e, K: tl.constexpr, K_PAD: tl.constexpr, PACKED: tl.constexpr):
    """(the router's top-K ids [K_PAD] in rank order, which expert each slot holds [K_PAD, E_PAD]) of
    the logits [E_PAD] (-inf past E), one element a thread: K block-wide maxima of `rank_keys`. For
    the routing program and SERE, which need every slot; a GEMM program takes `ranked_expert`."""
    k = tl.arange(0, K_PAD)
    key, lowest = rank_keys(logit, e, PACKED)
    ids = tl.zeros([K_PAD], dtype=tl.int64)
    for r in tl.static_range(K):
        best = tl.max(key, axis=0)
        ids = tl.where(k == r, (65535 - (best & 65535)).to(tl.int64), ids)
        key = tl.where(key == best, lowest, key)  # taken: below every key
    return ids, (e[None, :] == ids[:, None]) & (k[:, None] < K)


@triton.jit
def ranked_expert(logits_ptr, inv, slot, kept, E, dtype, K: tl.constexpr, E_PAD: tl.constexpr, PACKED: tl.constexpr,
                  WARPS: tl.constexpr, ROUTER_NORMALIZE: tl.constexpr, KEEP_NORMALIZE: tl.constexpr,
                  WEIGHT: tl.constexpr):
    """(the expert ranked `slot` (< K) by `rank_keys`, as `top_k_ids` ranks them; WEIGHT: its routing
    weight in float32, as `routing_weights` gives it, else 0) with no barrier between the K rounds
    (`folded_router.RANK_IN_WARPS`): every warp holds all E_PAD logits (an [E_PAD / 32, WARPS, 32]
    tile, whose middle axis Triton lays over the warps), so each round's maximum is one warp-wide
    reduction; one block-wide maximum at the end gives the scalar."""
    LANES: tl.constexpr = 32 if E_PAD >= 32 else E_PAD
    e = ((tl.arange(0, E_PAD // LANES) * LANES)[:, None, None] + tl.zeros([1, WARPS, 1], dtype=tl.int32)
         + tl.arange(0, LANES)[None, None, :])
    logit = scaled_logits(logits_ptr, inv, e, E, dtype)
    key, lowest = rank_keys(logit, e, PACKED)
    found = tl.full([WARPS], lowest, dtype=key.dtype)
    live = e < 0  # the kept slots' experts, all False so far
    for r in tl.static_range(K):
        best = tl.max(tl.max(key, axis=2), axis=0)  # [WARPS], each warp's own
        found = tl.where(slot == r, best, found)
        taken = key == best[None, :, None]
        live = live | (taken & (r < kept))
        key = tl.where(taken, lowest, key)
    expert = (65535 - (tl.max(found, axis=0) & 65535)).to(tl.int64)
    weight = 0.0
    if WEIGHT:  # each warp's sums over its own copy of the logits, then the one scalar
        p = tl.exp(logit - tl.max(tl.max(logit, axis=2), axis=0)[None, :, None])
        p_slot = tl.sum(tl.sum(tl.where(e == expert, p, 0.0), axis=2), axis=0)
        normalize = _normalizes(kept, K, ROUTER_NORMALIZE, KEEP_NORMALIZE)
        total = tl.where(normalize, tl.sum(tl.sum(tl.where(live, p, 0.0), axis=2), axis=0),
                         tl.sum(tl.sum(p, axis=2), axis=0))
        weight = tl.where(slot < kept, tl.max(p_slot / total, axis=0), 0.0)
    return expert, weight


@triton.jit
def _normalizes(kept, K: tl.constexpr, ROUTER_NORMALIZE: tl.constexpr, KEEP_NORMALIZE: tl.constexpr):
    """Whether the weights are renormalised over the kept slots: the router's choice where the token
    keeps all K, the kept slots' (OEA, truncation) otherwise."""
    return ((kept == K) & ROUTER_NORMALIZE) | ((kept != K) & KEEP_NORMALIZE)


@triton.jit
def routing_weights(logit, chosen, kept, K: tl.constexpr, K_PAD: tl.constexpr, ROUTER_NORMALIZE: tl.constexpr,
                    KEEP_NORMALIZE: tl.constexpr):
    """The slots' weights [K_PAD] (float32) from the logits [E_PAD] and which expert each slot holds
    ([K_PAD, E_PAD], `top_k_ids`): the first `kept` slots' probabilities, renormalised over them where
    `_normalizes` says so; 0 for the others."""
    k = tl.arange(0, K_PAD)
    p = tl.exp(logit - tl.max(logit, axis=0))  # softmax numerators (padding: exp(-inf) = 0)
    p_kept = tl.where(k < kept, tl.sum(tl.where(chosen, p[None, :], 0.0), axis=1), 0.0)
    total = tl.where(_normalizes(kept, K, ROUTER_NORMALIZE, KEEP_NORMALIZE), tl.sum(p_kept, axis=0),
                     tl.sum(p, axis=0))
    return p_kept / total


@triton.jit
def sere_moves(router_ids, chosen, e, E, sim_ptr, protect_ptr, threshold, opt_out_ptr, K: tl.constexpr,
                K_PAD: tl.constexpr, K1: tl.constexpr, HAS_OPT_OUT: tl.constexpr):
    """A lone token's ids after SERE (`sere_reroute_reference` for a batch of one): its first K1
    experts are the primary set; a later slot holding an unprotected e moves to the primary most
    similar to e (the lowest id at a tie) where that similarity reaches the threshold, unless the
    token opted out."""
    k = tl.arange(0, K_PAD)
    sim = tl.load(sim_ptr + router_ids[:, None] * E + e[None, :], mask=(k[:, None] < K) & (e[None, :] < E),
                  other=float("-inf"))
    primary = tl.sum(((k[:, None] < K1) & chosen).to(tl.int32), axis=0) > 0
    sim = tl.where(primary[None, :], sim, float("-inf"))
    protected = tl.load(protect_ptr + router_ids, mask=k < K, other=0).to(tl.int32)
    move = (k >= K1) & (protected == 0) & (tl.max(sim, axis=1) >= threshold)
    if HAS_OPT_OUT:
        move = move & (tl.load(opt_out_ptr).to(tl.int32) == 0)
    return tl.where(move, tl.argmax(sim, axis=1, tie_break_left=True).to(tl.int64), router_ids)


@triton.jit
def store_routing(router_ids, ids, weights, kept, router_ids_ptr, ids_ptr, weights_ptr, tiles_ptr, K: tl.constexpr,
                  K_PAD: tl.constexpr):
    """The router's top-K ids; the ids computed: the first `kept` of `ids`, the other slots pointing
    at the first expert (weight 0, `routing_weights`); the weights; the down GEMM's tiles: the kept
    ids, -1 for a dropped slot."""
    k = tl.arange(0, K_PAD)
    live = k < kept
    tl.store(router_ids_ptr + k, router_ids, mask=k < K)
    tl.store(ids_ptr + k, tl.where(live, ids, tl.sum(tl.where(k == 0, router_ids, 0))), mask=k < K)
    tl.store(weights_ptr + k, weights.to(weights_ptr.dtype.element_ty), mask=k < K)
    tl.store(tiles_ptr + k, tl.where(live, ids, -1), mask=k < K)


@triton.jit
def routed_ids(logits_ptr, inv, E, dtype, sim_ptr, protect_ptr, threshold, opt_out_ptr, SERE: tl.constexpr,
               K: tl.constexpr, K_PAD: tl.constexpr, K1: tl.constexpr, E_PAD: tl.constexpr,
               HAS_OPT_OUT: tl.constexpr, PACKED: tl.constexpr):
    """(the scaled logits [E_PAD], the router's top-K ids [K_PAD], which expert each slot holds
    [K_PAD, E_PAD], the ids computed: under SERE after `sere_moves`, else the router's) of a lone
    token, every slot ranked block-wide."""
    e = tl.arange(0, E_PAD)
    logit = scaled_logits(logits_ptr, inv, e, E, dtype)
    router_ids, chosen = top_k_ids(logit, e, K, K_PAD, PACKED)
    ids = router_ids
    if SERE:
        ids = sere_moves(router_ids, chosen, e, E, sim_ptr, protect_ptr, threshold, opt_out_ptr, K, K_PAD, K1,
                         HAS_OPT_OUT)
    return logit, router_ids, chosen, ids
