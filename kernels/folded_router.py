"""One decode token's MoE block with its router folded into the attention's output projection:
two launches (Triton) where the output projection, the router and the two expert GEMMs were four;
beside its PyTorch reference.

Why. At batch 1 the router is a launch of its own (`router.add_norm_router`, 8.0 us a layer on
the H200 for 0.5 MB of weights) only because it needs the whole residual row h = r + W_o a (r the
residual stream, a the heads' outputs) before it can start. RMSNorm is a per-row scale, so

    logits = W_r (g * h / rms(h)) = ((W_r g) r + (W_r g W_o) a) / rms(h)

where g is the norm's weight: the router rows W_r g (over r) and W_r g W_o (over a) are folded
once at load (`fold_router`), and their dot products need only what the output projection reads
itself. So:

1. `_out_proj_logits_kernel`: the output projection's rows with the residual add (h, stored), y =
   g * h (stored), and in E / BLOCK_N programs more the router's logits before the norm's scale
   (float32); on a Hopper GPU the same launch in Gluon, each program's rows copied into shared
   memory before its wait (`out_proj_smem.py`, OUT_PROJ_SMEM);
2. `_routed_gate_up_kernel`: every program takes h's RMS and the top-K of the scaled logits itself
   (4 kB and 512 B from L2), finds its slot's expert and weight, runs the gate and up GEMMs on y
   (their sums times 1 / RMS) for its columns, then those columns' share of the down GEMM, times
   the weight, added into its slot's float32 row (`fold_experts`); one program more stores the
   ids and weights. The next layer's q/k/v launch sums the slots with its residual add. (FUSED_DOWN
   off: the gate/up programs store their columns and a third launch, `fused_moe.down_per_slot`, runs
   the down GEMM.)

A routing policy that leaves a lone token its first n experts (OEA: alone, a token's top-k0 is the
whole union; truncation) is served too, in the same launches: the slots from n on get weight 0 and
no gate/up program, so their rows stay zero and no expert is read for them. So is SERE: alone, a
token's first K' experts are its batch's primary set, and each later slot may move to the most
similar of them (`fold_routing.sere_moves`, from the layer's similarity row and protection); a moved
slot runs its primary's GEMMs again, at about the time the primary's own programs read those
weights. The routing's pieces: `fold_routing.py`.

The logits differ from the reference's by rounding only: the reference rounds W_o a, h and x to
the model's dtype before the router's GEMM, the fold rounds its folded rows once. Both then round
the logits to the model's dtype, so the top-K differs only where two experts' logits were within
that rounding of each other. Called by `engine/model.py` (`Qwen3VLMoeTextDecoder._folded_route`).
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from .dependent_launch import ahead_width, hopper_or_later, launch_options, wait_for_inputs
from .fold_experts import down_columns, down_into_slot, token_tile
from .fold_routing import ranked_expert, routed_ids, routing_weights, store_routing
from .fused_moe import (down_config, down_per_slot, fused_experts_reference, gate_up_pointers, gate_up_step,
                        launch_options_moe, pick_config, silu_mul, store_silu_mul)
from .gemv import (GEMV_BLOCK_K, GEMV_WARPS, gemv_first_columns, gemv_first_sums, gemv_rows,
                   gemv_rows_from)
from .layer_ops import inverse_rms, weighted
from .out_proj_smem import out_proj_logits_smem_kernel
from .router import add_norm_router_reference
from .sere_reroute import sere_reroute_reference

import triton  # after zipmoe.kernels (the package) chose the interpreter on CPU-only machines
import triton.language as tl


# Built and measured for Qwen3-30B-A3B's 128 experts (each gate/up program takes the top-K of all E
# logits itself); more, and the model keeps the unfolded router.
FOLD_MAX_EXPERTS = 128
# The fold's expert GEMMs take at most this many pipeline stages. The sweep tunes the MoE layer
# alone (`fused_moe.pick_config`: 4 at batch 1); in the step, where the down GEMM holds rows loaded
# ahead of its wait, 3 made the batch-1 step 2.4 % faster and 2 slower (H100, session 38).
FOLD_STAGES = 3
# Gate/up columns a program of the fold takes (0: its tile's width), in a tile the next power of two
# wide (16 at least). 24 spreads Qwen3-30B-A3B's 8 x 768 over 256 programs, about two on every
# multiprocessor (at 255 registers a program, two at most): the batch-1 step 0-1.3 % faster at a
# 256-token context than 32 columns (192 programs, two on some multiprocessors and one on the
# others) and 0.6-1.5 % at 4,096, over two runs; 48 (128 programs) 3-4 % slower (H100, session 43,
# bench_step_knobs' "columns" set).
FOLD_COLUMNS = 24
# Rows of the output projection (and of the folded router) a program of `_out_proj_logits_kernel`
# takes, as `gemv` takes them (544 programs at the 30B shape). 2 rows (1,088 programs, 96 registers
# instead of 160) and 1 row were within the batch-1 step's noise of 4 over four runs (+-1 %, H100,
# sessions 43 and 44, bench_step_knobs' "columns" and "out_proj" sets), all of the rows' weights
# loaded ahead of the wait 0-2 % slower.
OUT_PROJ_ROWS = 4
# The K tile of the fold's gate/up GEMM, whatever the MoE layer's tuned config: at 256 a program takes
# 80 kB of shared memory, so at most two share a multiprocessor. Where a program needs little (64
# registers since the top-K takes K rounds of a max, 40 kB at the tuned 128), the launch, placed
# while the output projection still holds most multiprocessors, stacks up to five on the few with
# room, and the batch-1 step was 2.5-2.8 % slower than with the one-pass ranking it replaced; at 256
# it is 2.2-2.4 % faster (H100, session 45, bench_step_knobs' "top_k" set).
FOLD_GATE_UP_BLOCK_K = 256
# Each gate/up program ranks its slot's expert within each warp (`ranked_expert`: 5 barriers before
# its first weight load at sm_90, `sass_report`), not block-wide as the routing program does
# (`top_k_ids`: a shared-memory round trip each of the K rounds, 26 barriers). The batch-1 step was
# 3-4 us faster at a 256-token context in two runs, 1 and 25 us at 4,096 (H100, session 51,
# bench_step_knobs' "top_k" set): under 1 %.
RANK_IN_WARPS = True
# Each gate/up program runs its own share of its slot's down GEMM (`fold_experts`): its COLUMNS of
# SiLU(gate) * up never leave its registers, the down GEMM is no launch of its own, and the slots'
# outputs are float32 sums of the programs' atomics (their order, so their last bits, free; plain
# stores in their place were no faster). It reads its columns' rows of the [E, I, H] down weight whole:
# the batch-1 top-K step 73 us faster (2.6 %) than the three launches of before session 52, graph
# replay at a 256-token context (H100, decode bench, the same copy bandwidth); with the down GEMM as
# its own launch on the [E, I, H] weight, 150-156 us at 256 tokens and 177-181 at 4,096 (the
# "fused_down" knob set). With the [E, H, I] weight, where each program read 48-byte pieces of the
# down rows, the fused path was 80-95 us slower than the three launches. DOWN_N: the down rows a step
# of that loop takes (128: 72-78 us slower than 256); DOWN_AHEAD (0 or a power of two): rows loaded
# before the gate/up loop (256: 52-58 us slower than none).
FUSED_DOWN = True
DOWN_N = 256
DOWN_AHEAD = 0
# The output projection's launch with each program's rows copied whole into shared memory before its
# wait (`out_proj_smem`, Gluon), at most OUT_PROJ_SMEM_DEPTH steps of 512 columns a program in flight,
# where the GPU runs it (Hopper on), the slots are zeroed (FUSED_DOWN), the weights take 2 bytes and a
# program's step is one layout tile wide (GEMV_BLOCK_K); else the Triton kernel, half of each program's
# rows in registers across the wait. At most 2 steps in flight: the batch-1 step 0.4-1.2 % faster on an
# H100 at 256 and 4,096 tokens (two runs, session 57), 1.0-1.4 % at 256 and even at 4,096 on an H200
# (session 55); bench_step_knobs' "out_proj_smem" set.
OUT_PROJ_SMEM = True
OUT_PROJ_SMEM_DEPTH = 2  # 0: every step in flight at once


def _out_proj_in_shared_memory(h: torch.Tensor, A: int, block_k: int) -> bool:
    """Whether `folded_moe` takes `out_proj_smem`'s launch (OUT_PROJ_SMEM)."""
    return (OUT_PROJ_SMEM and FUSED_DOWN and hopper_or_later(h.device) and h.element_size() == 2
            and block_k == 8 * 32 * GEMV_WARPS and A % block_k == 0 and h.shape[1] % block_k == 0)


def fold_router(gate: torch.Tensor, norm: torch.Tensor, o_weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(W_r g [E, H], W_r g W_o [E, heads * head_dim]) in gate's dtype, from the router's weight
    [E, H], the MoE's input norm weight [H] and the output projection [H, heads * head_dim]; the
    product taken in float32 and rounded once."""
    scaled_gate = gate.float() * norm.float()[None, :]
    return scaled_gate.to(gate.dtype), (scaled_gate @ o_weight.float()).to(gate.dtype)


def folded_moe_reference(h, attn, o_weight, norm, gate, gate_r, gate_o, gate_up, down, top_k: int, normalize: bool,
                         keep: int, keep_normalize: bool, opt_out: torch.Tensor | None, eps: float,
                         similarity: torch.Tensor | None = None, protect: torch.Tensor | None = None,
                         primary_k: int = 0, threshold: float = 0.0):
    """A decode token's MoE block after its attention, unfolded: (h + a W_o^T, the slots' expert
    outputs times their weights [T, K, H] unsummed, the router's ids [T, K], the ids computed, their
    weights). keep < top_k: a token keeps its first `keep` experts (weights renormalised over them
    where keep_normalize), its other slots point at its first expert with weight 0 (what OEA and
    truncation do to a lone token), unless opt_out [T] (None: all False) says it keeps its top-K.
    similarity ([E, E]) and protect ([E]): the slots from primary_k on re-routed as SERE re-routes
    a batch of these tokens (`sere_reroute_reference`), the weights kept. h [T, H] the residual
    stream, attn [T, heads * head_dim]; gate_r and gate_o (`fold_router`) are not needed."""
    h, x, probs, router_ids, weights = add_norm_router_reference(h, F.linear(attn, o_weight), norm, gate, top_k,
                                                                 normalize, eps)
    ids = router_ids
    if keep < top_k:
        opt_out = torch.zeros(h.shape[0], dtype=torch.bool, device=h.device) if opt_out is None else opt_out
        live = (torch.arange(top_k, device=h.device) < keep)[None, :] | opt_out[:, None]
        p = torch.where(live, probs.gather(1, router_ids), 0.0)
        kept_w = (p / p.sum(dim=1, keepdim=True) if keep_normalize else p).to(weights.dtype)
        ids = torch.where(live, router_ids, router_ids[:, :1])
        weights = torch.where(opt_out[:, None], weights, kept_w)
    if similarity is not None:
        ids = sere_reroute_reference(ids, similarity, protect, opt_out, primary_k, threshold)
    per_slot = [fused_experts_reference(x, ids[:, k:k + 1], weights[:, k:k + 1], gate_up, down) for k in range(top_k)]
    return h, torch.stack(per_slot, dim=1), router_ids, ids, weights


@triton.jit
def _out_proj_logits_kernel(attn_ptr, res_ptr, o_ptr, norm_ptr, gate_r_ptr, gate_o_ptr, h_out_ptr, y_ptr,
                            logits_ptr, ready_ptr, acc_ptr, H, E, A: tl.constexpr, HK: tl.constexpr,
                            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, AHEAD: tl.constexpr,
                            ZERO_SLOTS: tl.constexpr, PDL: tl.constexpr):
    # Programs [0, cdiv(H, BLOCK_N)): rows of h = r + W_o a, each rounded as `gemv` then the residual
    # add round, and of y = g * h, the experts' input before the norm's 1 / RMS (a scalar the gate/up
    # kernel applies to its sums). The rest: rows of the folded router, (W_r g) r + (W_r g W_o) a in
    # float32.
    # The first AHEAD columns of the rows over a (W_o's, W_r g W_o's) are loaded ahead of the wait
    # (`dependent_launch.ahead_width`): no kernel writes them. So are r (and g) and the router's sums
    # over r, whole: r was written two launches before (by the q/k/v launch, before the attention),
    # and this launch starts only once every program of the attention has passed its own wait, which
    # the q/k/v launch's end let go. The logits programs were the launch's last to finish, with twice
    # the rows' loads after their wait; taking their sums over r first made the batch-1 step 0.8 %
    # faster at a 256-token context and 1.0 % at 4,096, in each of three interleaved pairs; the rows'
    # r and g then 1.2 % more at 256 tokens and 0-1 % at 4,096 (H100, session 44, bench_step_knobs).
    # ZERO_SLOTS (FUSED_DOWN): the rows' columns of the slots' sums acc [ZERO_SLOTS, H] zeroed, after
    # the wait (the memory may be a buffer the launches before still read), for the gate/up launch's
    # atomics.
    pid = tl.program_id(0)
    out_programs = tl.cdiv(H, BLOCK_N)
    if pid < out_programs:
        n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        r = tl.load(res_ptr + n, mask=n < H, other=0.0)  # before the wait (above)
        g = tl.load(norm_ptr + n, mask=n < H, other=0.0)
        o = _rows_times_attention(attn_ptr, o_ptr, n, H, A, BLOCK_N, BLOCK_K, AHEAD, PDL)
        if ZERO_SLOTS == 0:  # the down GEMM its own launch: ready lowered before the routing program raises it
            if pid == 0:
                tl.store(ready_ptr, 0)
        h = (r.to(tl.float32) + o.to(r.dtype).to(tl.float32)).to(r.dtype)
        tl.store(h_out_ptr + n, h, mask=n < H)
        tl.store(y_ptr + n, weighted(h, g), mask=n < H)
        for k in tl.static_range(ZERO_SLOTS):
            tl.store(acc_ptr + k * H + n, tl.zeros([BLOCK_N], dtype=tl.float32), mask=n < H)
    else:
        e = (pid - out_programs) * BLOCK_N + tl.arange(0, BLOCK_N)
        over_r = gemv_rows(res_ptr, gate_r_ptr, e, E, HK, BLOCK_N, BLOCK_K)  # before the wait (above)
        o = _rows_times_attention(attn_ptr, gate_o_ptr, e, E, A, BLOCK_N, BLOCK_K, AHEAD, PDL)
        tl.store(logits_ptr + e, over_r + o, mask=e < E)


@triton.jit
def _rows_times_attention(attn_ptr, w_ptr, n, N, A: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                          AHEAD: tl.constexpr, PDL: tl.constexpr):
    """gemv_rows(a, w) of rows n, waiting for a after loading w's first AHEAD columns."""
    if AHEAD:
        w = gemv_first_columns(w_ptr, n, N, A, AHEAD)
        wait_for_inputs(PDL)
        acc = gemv_first_sums(w, attn_ptr, BLOCK_N, BLOCK_K, AHEAD)
    else:
        wait_for_inputs(PDL)
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    return gemv_rows_from(attn_ptr, w_ptr, n, N, A, BLOCK_N, BLOCK_K, acc, AHEAD)


@triton.jit
def _routed_gate_up_kernel(h_ptr, y_ptr, logits_ptr, opt_out_ptr, w_ptr, out_ptr, down_ptr, acc_ptr, router_ids_ptr,
                           ids_ptr, weights_ptr, tiles_ptr, ready_ptr, sim_ptr, protect_ptr, threshold, H, I, E, eps,
                           K: tl.constexpr, KEEP: tl.constexpr, SERE: tl.constexpr, K1: tl.constexpr,
                           E_PAD: tl.constexpr, K_PAD: tl.constexpr, H_PAD: tl.constexpr,
                           ROUTER_NORMALIZE: tl.constexpr, KEEP_NORMALIZE: tl.constexpr, HAS_OPT_OUT: tl.constexpr,
                           COLUMNS: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
                           PACKED: tl.constexpr, RANK_IN_WARPS: tl.constexpr, WARPS: tl.constexpr,
                           FUSED_DOWN: tl.constexpr, DOWN_AHEAD: tl.constexpr, DOWN_N: tl.constexpr,
                           PDL: tl.constexpr):
    # Program (slot, column tile). Every program routes the token itself: the row's RMS, the logits
    # scaled by it and rounded to the model's dtype (as F.linear rounds them) and the expert ranked
    # `slot` (`ranked_expert`: K rounds of a max within each warp, as this is on the path to the
    # first weight load; under SERE every slot's, `top_k_ids`, for the moves). The GEMM's input is
    # y = g * h as stored, its sums scaled by 1 / RMS after the loop, so the loop is the plain gate/up kernel's
    # (x = rms_norm(h) computed in the loop, a tile at a time, cost 4.4 us a layer on the H100: its
    # operand no longer streamed straight from memory). Program 0 computes no slot: it stores the
    # routing, off the GEMM programs' path; programs 1 on are (slot, column tile), slot fastest, K x I /
    # COLUMNS of them (256 at the 30B shape, two a multiprocessor). The grid was (K + 1, I / COLUMNS):
    # 288 programs for 264 places, 31 of them returning at once, so 24 GEMM programs were placed only
    # after the wait; the batch-1 step was within 0.1 % either way (H100, session 47).
    # KEEP < K: slots from KEEP on are dropped (no GEMM; the down GEMM skips them too), unless the
    # token opted out of re-routing (HAS_OPT_OUT: opt_out_ptr). SERE: every slot kept, those from K1
    # on moved as `sere_moves` says (a moved slot reads its primary's weights again, at about the
    # time the primary's programs read them).
    wait_for_inputs(PDL)
    pid = tl.program_id(0) - 1
    slot = tl.where(pid < 0, K, pid % K)
    pid_n = pid // K
    kept = KEEP
    if HAS_OPT_OUT and KEEP < K:
        kept = tl.where(tl.load(opt_out_ptr).to(tl.int1), K, KEEP)
    if (slot >= kept) & (slot < K):  # a dropped slot (K itself routes, below)
        return
    row = tl.arange(0, H_PAD)
    inv = inverse_rms(tl.load(h_ptr + row, mask=row < H, other=0.0), H, eps)
    dtype = h_ptr.dtype.element_ty
    if slot == K:
        logit, router_ids, chosen, ids = routed_ids(logits_ptr, inv, E, dtype, sim_ptr, protect_ptr, threshold,
                                                    opt_out_ptr, SERE, K, K_PAD, K1, E_PAD, HAS_OPT_OUT, PACKED)
        weights = routing_weights(logit, chosen, kept, K, K_PAD, ROUTER_NORMALIZE, KEEP_NORMALIZE)
        store_routing(router_ids, ids, weights, kept, router_ids_ptr, ids_ptr, weights_ptr, tiles_ptr, K, K_PAD)
        if not FUSED_DOWN:  # the down GEMM's programs, launched behind this one, wait for ready to load
            # their experts' weights ahead (`fused_moe.down_per_slot`): raised once every thread's stores are out.
            tl.debug_barrier()
            tl.atomic_xchg(ready_ptr, 1, sem="release")
    else:
        if SERE or not RANK_IN_WARPS:  # every slot's id (SERE: for the moves)
            logit, _, chosen, ids = routed_ids(logits_ptr, inv, E, dtype, sim_ptr, protect_ptr, threshold,
                                               opt_out_ptr, SERE, K, K_PAD, K1, E_PAD, HAS_OPT_OUT, PACKED)
            expert = tl.sum(tl.where(tl.arange(0, K_PAD) == slot, ids, 0))
            weight = 0.0
            if FUSED_DOWN:
                weights = routing_weights(logit, chosen, kept, K, K_PAD, ROUTER_NORMALIZE, KEEP_NORMALIZE)
                weight = tl.sum(tl.where(tl.arange(0, K_PAD) == slot, weights, 0.0))
        else:
            expert, weight = ranked_expert(logits_ptr, inv, slot, kept, E, dtype, K, E_PAD, PACKED, WARPS,
                                           ROUTER_NORMALIZE, KEEP_NORMALIZE, FUSED_DOWN)
        m = tl.arange(0, BLOCK_M)
        cols = pid_n * COLUMNS + tl.arange(0, BLOCK_N)  # COLUMNS of the BLOCK_N-wide tile are real
        col_real = (tl.arange(0, BLOCK_N) < COLUMNS) & (cols < I)
        col_ok = col_real[None, :]
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        ks = tl.arange(0, BLOCK_K)
        w_gate, w_up = gate_up_pointers(w_ptr, expert, cols, H, I)
        w_down = 0
        if DOWN_AHEAD:  # the down GEMM's first rows (FUSED_DOWN), held through the gate/up loop
            w_down = down_columns(down_ptr, expert, cols, col_real, 0, H, I, DOWN_AHEAD)
        for k0 in range(0, H, BLOCK_K):
            acc_g, acc_u = gate_up_step(token_tile(y_ptr, k0, ks, H, BLOCK_M), w_gate, w_up, k0, ks, H, col_ok, acc_g,
                                        acc_u, PRECISION)
        if FUSED_DOWN:
            down_into_slot(silu_mul(acc_g * inv, acc_u * inv).to(dtype), w_down, down_ptr, acc_ptr, expert, slot,
                           weight.to(dtype).to(tl.float32), cols, col_real, H, I, BLOCK_M, DOWN_AHEAD, DOWN_N,
                           PRECISION)
        else:
            store_silu_mul(out_ptr, tl.where(m == 0, slot, 0), cols, m == 0, col_ok, acc_g * inv, acc_u * inv, I)


@torch.library.custom_op("zipmoe::folded_moe", mutates_args=())
def folded_moe(h: torch.Tensor, attn: torch.Tensor, o_weight: torch.Tensor, norm: torch.Tensor, gate: torch.Tensor,
               gate_r: torch.Tensor, gate_o: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, top_k: int,
               normalize: bool, keep: int, keep_normalize: bool, opt_out: torch.Tensor | None, eps: float,
               similarity: torch.Tensor | None = None, protect: torch.Tensor | None = None, primary_k: int = 0,
               threshold: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`folded_moe_reference`'s contract for one token in two launches (three without FUSED_DOWN), the
    dropped slots' experts not read; the slots' outputs float32 with FUSED_DOWN, else in h's dtype. gate,
    the unfolded router, is not read: gate_r and gate_o are its fold."""
    H, A = o_weight.shape
    E, two_i, _ = gate_up.shape
    I = two_i // 2
    if h.shape != (1, H) or attn.shape != (1, A):
        raise ValueError(f"folded_moe serves one token: h [1, {H}] and attn [1, {A}], got {tuple(h.shape)} and "
                         f"{tuple(attn.shape)}")
    if not 1 <= keep <= top_k:
        raise ValueError(f"folded_moe keeps 1 to top_k ({top_k}) experts, got {keep}")
    sere = similarity is not None
    if sere and (keep < top_k or not 1 <= primary_k < top_k or protect is None
                 or similarity.shape != (E, E) or similarity.dtype != torch.float32 or protect.shape != (E,)):
        raise ValueError(f"folded_moe re-routes as SERE with all {top_k} slots kept, 1 <= primary_k < {top_k}, "
                         f"similarity [{E}, {E}] float32 and protect [{E}]; got keep {keep}, primary_k {primary_k}, "
                         f"similarity {tuple(similarity.shape)} {similarity.dtype}, protect "
                         f"{None if protect is None else tuple(protect.shape)}")
    h, attn = h.contiguous(), attn.contiguous()
    h_out, y = torch.empty_like(h), torch.empty_like(h)
    logits = torch.empty(E, dtype=torch.float32, device=h.device)
    # FUSED_DOWN off: the routing stored (lowered, then raised); on, no kernel touches it (logits stand in).
    ready = logits if FUSED_DOWN else torch.empty(1, dtype=torch.int32, device=h.device)
    block_k = min(GEMV_BLOCK_K, triton.next_power_of_2(min(A, H)))
    # FUSED_DOWN: the slots' outputs are summed into here by the gate/up launch (zeroed by the first).
    per_slot = torch.empty(top_k, H, dtype=torch.float32, device=h.device) if FUSED_DOWN else None
    out_grid = (triton.cdiv(H, OUT_PROJ_ROWS) + triton.cdiv(E, OUT_PROJ_ROWS),)
    if _out_proj_in_shared_memory(h, A, block_k):
        out_proj_logits_smem_kernel[out_grid](
            attn, h, o_weight, norm, gate_r, gate_o, h_out, y, logits, per_slot, H, E, A=A, HK=H,
            BLOCK_N=OUT_PROJ_ROWS, BLOCK_K=block_k, DEPTH=OUT_PROJ_SMEM_DEPTH, ZERO_SLOTS=top_k, WARPS=GEMV_WARPS,
            num_warps=GEMV_WARPS, **launch_options(h.device))
    else:
        _out_proj_logits_kernel[out_grid](
            attn, h, o_weight, norm, gate_r, gate_o, h_out, y, logits, ready, logits if per_slot is None else per_slot,
            H, E, A=A, HK=H, BLOCK_N=OUT_PROJ_ROWS, BLOCK_K=block_k, AHEAD=ahead_width(A, block_k),
            ZERO_SLOTS=top_k if FUSED_DOWN else 0, num_warps=GEMV_WARPS, **launch_options(h.device))
    cfg = pick_config(1, E, H, I, h.element_size())
    cfg = dataclasses.replace(cfg, num_stages=min(cfg.num_stages, FOLD_STAGES))
    router_ids, ids, tiles = (torch.empty(1, top_k, dtype=torch.int64, device=h.device) for _ in range(3))
    weights = torch.empty(1, top_k, dtype=h.dtype, device=h.device)
    hidden = per_slot if FUSED_DOWN else torch.empty(top_k, I, dtype=h.dtype, device=h.device)
    columns = FOLD_COLUMNS or cfg.block_n
    up_cfg = dataclasses.replace(cfg, block_n=max(16, triton.next_power_of_2(columns)),  # tl.dot's least
                                 block_k=FOLD_GATE_UP_BLOCK_K or cfg.block_k)
    _routed_gate_up_kernel[(1 + top_k * triton.cdiv(I, columns),)](
        h_out, y, logits, logits if opt_out is None else opt_out, gate_up, hidden, down, hidden, router_ids, ids,
        weights, tiles, ready, similarity.contiguous() if sere else logits,
        protect.contiguous() if sere else logits, float(threshold), H, I, E, eps, K=top_k, KEEP=keep, SERE=sere,
        K1=primary_k if sere else 1, E_PAD=triton.next_power_of_2(E), K_PAD=triton.next_power_of_2(top_k),
        H_PAD=triton.next_power_of_2(H), ROUTER_NORMALIZE=normalize, KEEP_NORMALIZE=keep_normalize,
        HAS_OPT_OUT=opt_out is not None, COLUMNS=columns, PACKED=h.dtype == torch.bfloat16,
        RANK_IN_WARPS=RANK_IN_WARPS, WARPS=up_cfg.num_warps, FUSED_DOWN=FUSED_DOWN,
        DOWN_AHEAD=DOWN_AHEAD if FUSED_DOWN else 0, DOWN_N=DOWN_N,
        **launch_options_moe(up_cfg, h))
    if FUSED_DOWN:
        return h_out, per_slot.view(1, top_k, H), router_ids, ids, weights
    # Each slot a tile (under SERE a moved slot reads its primary's down rows again).
    per_slot = down_per_slot(hidden, down, weights, tiles, tiles.reshape(-1), down_config(cfg), slot_tiles=True,
                             ready=ready)
    return h_out, per_slot.view(1, top_k, H), router_ids, ids, weights


@folded_moe.register_fake
def _(h, attn, o_weight, norm, gate, gate_r, gate_o, gate_up, down, top_k, normalize, keep, keep_normalize, opt_out,
      eps, similarity=None, protect=None, primary_k=0, threshold=0.0):
    ids = h.new_empty(1, top_k, dtype=torch.int64)
    per_slot = h.new_empty(1, top_k, h.shape[1], dtype=torch.float32 if FUSED_DOWN else h.dtype)
    return torch.empty_like(h), per_slot, ids, torch.empty_like(ids), h.new_empty(1, top_k)
