"""Fused MoE experts (Triton): gate_up -> SiLU*mul -> down -> routing-weighted sum over slots.

A decode step is memory-bound: what costs is reading each activated expert's weights, so the
kernels read every expert of the batch's union exactly once per call and nothing else big.
Slots (token, rank) are grouped by expert into tiles of BLOCK_M rows (`moe_align.py`); a program
owns one (tile, column tile) pair and streams its expert's weights through registers.

Everything has a fixed shape given (tokens, top_k, experts): the tile count is bounded by
min(E, S) + cdiv(S, BLOCK_M) for S = tokens * top_k slots, tiles past the used ones exit at
once, and nothing is read back to the host. So a decode step using these kernels can be
captured in a CUDA graph and replayed with other routing.

`fused_experts` is the kernel the engine calls on CUDA, as `fused_experts_per_slot`, which leaves
the sum over slots to the next launch (`fused_experts_with_config`: the same launches with an
explicit tile shape, for tests and the tuning sweep); `fused_experts_reference`
beside it, a loop over the experts the batch activates, is what the engine runs elsewhere.
"""
from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from .dependent_launch import ahead_width, launch_options, wait_for_inputs
from .moe_align import moe_align

import triton  # after zipmoe.kernels (the package) chose the interpreter on CPU-only machines
import triton.language as tl


@dataclass(frozen=True)
class MoeConfig:
    """Tile shape of both expert GEMMs; `decode` for a few slots per expert, `prefill` for many."""
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


# Tuned tile shapes per device and expert shape, written by
# `python -m zipmoe.kernels.benchmarks.bench_kernels --sweep` (as vLLM keeps its fused-MoE configs).
TUNED_CONFIGS = Path(__file__).with_name("fused_moe_configs.json")
# The down weight is [E, I, H] (`engine/model.py` transposes the checkpoint's [E, H, I] at load), so
# that one decode token's gate/up programs read their share of it as whole rows (`folded_router`'s
# FUSED_DOWN). The down GEMM's tile then spans BLOCK_N columns of H: at the tuned 32 (64-byte pieces
# of each row) the batch-16 and 64 steps were 11-15 % slower than with the [E, H, I] weight; at
# 128 x 64 (columns x rows) they are within 0.5 % of it, pipelined (H100, session 52, decode bench).
DOWN_BLOCK_N, DOWN_BLOCK_K = 128, 64


@functools.lru_cache(maxsize=None)
def config_key(num_experts: int, hidden: int, width: int) -> str:
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return f"{device},E={num_experts},H={hidden},I={width}"


@functools.lru_cache(maxsize=None)
def _tuned(key: str) -> dict[int, MoeConfig]:
    if not TUNED_CONFIGS.exists():
        return {}
    table = json.loads(TUNED_CONFIGS.read_text()).get(key, {})
    return {int(t): MoeConfig(*cfg) for t, cfg in table.items()}


def down_config(cfg: MoeConfig) -> MoeConfig:
    """The down GEMM's tile for the tile shape cfg (the gate/up GEMM's): at least DOWN_BLOCK_N columns
    and at most DOWN_BLOCK_K rows of the [E, I, H] weight a step."""
    return dataclasses.replace(cfg, block_n=max(cfg.block_n, DOWN_BLOCK_N), block_k=min(cfg.block_k, DOWN_BLOCK_K))


def pick_config(num_tokens: int, num_experts: int, hidden: int, width: int, elem_bytes: int = 2) -> MoeConfig:
    """The tuned shape for the smallest tuned batch >= num_tokens; else a default that keeps every
    expert's slots of a decode batch in one tile (so its weights are read once) and fits shared
    memory for bf16 and float32."""
    tuned = _tuned(config_key(num_experts, hidden, width)) if elem_bytes == 2 else {}
    fits = [t for t in tuned if t >= num_tokens]
    if fits:
        return tuned[min(fits)]
    if num_tokens > 256:
        return MoeConfig(64, 128, 64 // (elem_bytes // 2), 8, 3)
    block_m = min(max(16, triton.next_power_of_2(num_tokens)), 64)
    return MoeConfig(block_m, 64, 128 // (elem_bytes // 2), 4 if block_m <= 32 else 8, 3)


@triton.jit
def _tile(tile_expert_ptr, tile_slots_ptr, S, read, BLOCK_M: tl.constexpr, SLOT_TILES: tl.constexpr):
    """This program's tile: its expert (-1: unused tile; -1 too, nothing read, where `read` is
    False), its slots, and which of them are real. SLOT_TILES: tile g is slot g alone and
    tile_expert_ptr the slots' experts (no align; -1: a slot the routing dropped)."""
    g = tl.program_id(0)
    expert = tl.load(tile_expert_ptr + g, mask=read, other=-1).to(tl.int64)
    if SLOT_TILES:
        slots = tl.where(tl.arange(0, BLOCK_M) == 0, g, S)
    else:
        slots = tl.load(tile_slots_ptr + g * BLOCK_M + tl.arange(0, BLOCK_M))
    return expert, slots, slots < S


@triton.jit
def gate_up_pointers(w_ptr, expert, cols, H, I):
    """Columns `cols` of an expert's gate and up rows: [0, I) and [I, 2I) of its fused [2I, H] matrix."""
    w_gate = w_ptr + expert * 2 * I * H + cols[None, :].to(tl.int64) * H
    return w_gate, w_gate + I * H


@triton.jit
def gate_up_step(a, w_gate, w_up, k0, ks, H, col_ok, acc_g, acc_u, PRECISION: tl.constexpr):
    """One step of the gate and up GEMMs over input columns k0 + ks, for the tile's inputs a."""
    k_ok = k0 + ks < H
    g = tl.load(w_gate + k0 + ks[:, None], mask=k_ok[:, None] & col_ok, other=0.0)
    u = tl.load(w_up + k0 + ks[:, None], mask=k_ok[:, None] & col_ok, other=0.0)
    return tl.dot(a, g, acc_g, input_precision=PRECISION), tl.dot(a, u, acc_u, input_precision=PRECISION)


@triton.jit
def silu_mul(acc_g, acc_u):
    """SiLU(gate) * up, in float32."""
    return acc_g * tl.sigmoid(acc_g) * acc_u


@triton.jit
def store_silu_mul(out_ptr, slots, cols, valid, col_ok, acc_g, acc_u, I):
    """SiLU(gate) * up of the tile's slots, stored as the down GEMM's input rows."""
    h = silu_mul(acc_g, acc_u)
    tl.store(out_ptr + slots[:, None].to(tl.int64) * I + cols[None, :], h.to(out_ptr.dtype.element_ty),
             mask=valid[:, None] & col_ok)


@triton.jit
def _gate_up_kernel(x_ptr, w_ptr, out_ptr, tile_slots_ptr, tile_expert_ptr, S, H, I,
                    TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    PRECISION: tl.constexpr, SLOT_TILES: tl.constexpr, PDL: tl.constexpr):
    wait_for_inputs(PDL)
    pid_n = tl.program_id(1)
    expert, slots, valid = _tile(tile_expert_ptr, tile_slots_ptr, S, True, BLOCK_M, SLOT_TILES)
    if expert < 0:
        return
    tokens = (slots // TOP_K).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + tokens[:, None] * H
    w_gate, w_up = gate_up_pointers(w_ptr, expert, cols, H, I)
    col_ok = cols[None, :] < I
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        a = tl.load(x_rows + k0 + ks[None, :], mask=valid[:, None] & (k0 + ks < H)[None, :], other=0.0)
        acc_g, acc_u = gate_up_step(a, w_gate, w_up, k0, ks, H, col_ok, acc_g, acc_u, PRECISION)
    store_silu_mul(out_ptr, slots, cols, valid, col_ok, acc_g, acc_u, I)


@triton.jit
def _expert_rows(w_ptr, expert, cols, col_ok, k, H, I):
    """Rows k of the down weight [E, I, H] at columns `cols` for `expert` ([len(k), BLOCK_N]; zeros,
    nothing read, where expert is -1)."""
    return tl.load(w_ptr + tl.maximum(expert, 0) * I * H + k[:, None].to(tl.int64) * H + cols[None, :],
                   mask=(expert >= 0) & (k[:, None] < I) & col_ok, other=0.0)


@triton.jit
def _down_kernel(h_ptr, w_ptr, weight_ptr, out_ptr, tile_slots_ptr, tile_expert_ptr, ready_ptr, S, H, I,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
                 SLOT_TILES: tl.constexpr, AHEAD: tl.constexpr, PDL: tl.constexpr,
                 READY_TRIES: tl.constexpr = 64):
    pid_n = tl.program_id(1)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols[None, :] < H
    if AHEAD:
        # One token's slots (`folded_router`): the launch before stores their experts early, then
        # raises ready, and runs its GEMMs for a while yet; so the first AHEAD rows of this tile's
        # weights are loaded before the wait. (This launch starts only once every program of that one
        # has passed its own wait: the output projection's launch, which lowered ready, is done, and
        # the routing program is running, so ready will rise; a program that has not seen it after
        # READY_TRIES tries loads those rows after the wait instead.)
        seen = tl.atomic_add(ready_ptr, 0, sem="acquire")
        tries = 0
        while (seen == 0) & (tries < READY_TRIES):
            seen = tl.atomic_add(ready_ptr, 0, sem="acquire")
            tries += 1
        first = tl.arange(0, AHEAD)
        early = tl.load(tile_expert_ptr + tl.program_id(0), mask=seen != 0, other=-1).to(tl.int64)
        w_first = _expert_rows(w_ptr, early, cols, col_ok, first, H, I)
    wait_for_inputs(PDL)
    if AHEAD:  # the expert read before the wait (stored for good before ready rose) is not asked for again
        expert, slots, valid = _tile(tile_expert_ptr, tile_slots_ptr, S, seen == 0, BLOCK_M, SLOT_TILES)
        expert = tl.where(seen != 0, early, expert)
    else:
        expert, slots, valid = _tile(tile_expert_ptr, tile_slots_ptr, S, True, BLOCK_M, SLOT_TILES)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    out_rows = out_ptr + slots[:, None].to(tl.int64) * H + cols[None, :]
    if expert < 0:
        if SLOT_TILES:  # a slot its routing dropped (`folded_router`): its output row is zero, no expert read
            tl.store(out_rows, acc.to(out_ptr.dtype.element_ty), mask=valid[:, None] & col_ok)
        return
    ks = tl.arange(0, BLOCK_K)
    h_rows = h_ptr + slots[:, None].to(tl.int64) * I
    w_cols = w_ptr + expert * I * H + cols[None, :]
    if AHEAD:
        w_first = tl.where(seen != 0, w_first, _expert_rows(w_ptr, tl.where(seen != 0, -1, expert), cols, col_ok,
                                                             first, H, I))
        a_first = tl.load(h_rows + first[None, :], mask=valid[:, None] & (first < I)[None, :], other=0.0)
        acc = tl.dot(a_first, w_first, acc, input_precision=PRECISION)
    for k0 in range(AHEAD, I, BLOCK_K):
        k_ok = k0 + ks < I
        a = tl.load(h_rows + k0 + ks[None, :], mask=valid[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_cols + (k0 + ks[:, None]).to(tl.int64) * H, mask=k_ok[:, None] & col_ok, other=0.0)
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
    weight = tl.load(weight_ptr + slots, mask=valid, other=0.0).to(tl.float32)
    acc = acc * weight[:, None]
    tl.store(out_rows, acc.to(out_ptr.dtype.element_ty), mask=valid[:, None] & col_ok)


def launch_options_moe(cfg: MoeConfig, x: torch.Tensor) -> dict:
    """The expert kernels' launch keywords for tile shape cfg and inputs like x."""
    return dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                # float32 weights (tests, the tiny model on CUDA) match the float32 reference, not TF32.
                PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
                num_warps=cfg.num_warps, num_stages=cfg.num_stages, **launch_options(x.device))


def down_per_slot(hidden: torch.Tensor, down: torch.Tensor, weights: torch.Tensor, tile_slots: torch.Tensor,
                  tile_expert: torch.Tensor, cfg: MoeConfig, slot_tiles: bool,
                  ready: torch.Tensor | None = None) -> torch.Tensor:
    """The down GEMM of the gate/up kernel's output rows [S, I]: each slot's output times its routing
    weight, [S, H] unsummed (also `folded_router.folded_moe`'s last launch). slot_tiles: tile g is slot
    g, tile_expert its expert, -1 where the slot is dropped (its row zero). ready (int32 [1], with
    slot_tiles): nonzero once the launch before has stored tile_expert, which it may still be
    running; each program then loads part of its weights before it waits for that launch."""
    S, I = hidden.shape
    H = down.shape[2]
    per_slot = torch.empty(S, H, dtype=hidden.dtype, device=hidden.device)
    _down_kernel[(tile_expert.numel(), triton.cdiv(H, cfg.block_n))](
        hidden, down, weights.reshape(-1).contiguous(), per_slot, tile_slots, tile_expert,
        tile_expert if ready is None else ready, S, H, I, SLOT_TILES=slot_tiles,
        AHEAD=0 if ready is None else ahead_width(I, cfg.block_k), **launch_options_moe(cfg, hidden))
    return per_slot


def fused_experts_reference(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                            gate_up: torch.Tensor, down: torch.Tensor, distinct_ids: bool = False) -> torch.Tensor:
    """Loop over the experts the batch activates (its union); each reads its weights once.

    x [T, H]; ids/weights [T, K]; gate_up [E, 2I, H]; down [E, I, H]. A token routed twice to the
    same expert gets both weights (policies may create duplicates). distinct_ids: the kernels' hint
    (`fused_experts_with_config`), which changes nothing here.
    """
    out = torch.zeros_like(x)
    for e in torch.unique(ids).tolist():
        token, slot = torch.where(ids == e)
        h = x[token]
        g, u = F.linear(h, gate_up[e]).chunk(2, dim=-1)
        y = (F.silu(g) * u) @ down[e] * weights[token, slot, None]
        out.index_add_(0, token, y.to(out.dtype))
    return out


def fused_experts_with_config(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                              down: torch.Tensor, config: MoeConfig | None = None, sum_slots: bool = True,
                              distinct_ids: bool = False) -> torch.Tensor:
    """`fused_experts` with the tile shape given (None: `pick_config`'s); sum_slots False: the
    weighted slot outputs [T, K, H] unsummed (`fused_experts_per_slot`). distinct_ids: the caller
    knows no token repeats an expert (the router's own top-K); a single such token needs no align,
    its K slots being K tiles already (one launch fewer a layer at batch 1)."""
    T, H = x.shape
    K = ids.shape[1]
    E, two_i, _ = gate_up.shape
    I = two_i // 2
    S = T * K
    cfg = config or pick_config(T, E, H, I, x.element_size())
    slot_tiles = distinct_ids and T == 1
    if slot_tiles:  # the kernels read each tile's expert from the ids; a repeated one would be read twice
        tile_slots, tile_expert = ids, ids.reshape(-1)
    else:
        tile_slots, tile_expert = moe_align(ids, E, cfg.block_m)
    G = tile_expert.numel()
    hidden = torch.empty(S, I, dtype=x.dtype, device=x.device)
    launch = launch_options_moe(cfg, x)
    _gate_up_kernel[(G, triton.cdiv(I, cfg.block_n))](
        x.contiguous(), gate_up, hidden, tile_slots, tile_expert, S, H, I, TOP_K=K, SLOT_TILES=slot_tiles, **launch)
    per_slot = down_per_slot(hidden, down, weights, tile_slots, tile_expert, down_config(cfg), slot_tiles)
    # Slot results in x's dtype, summed per token (float32 accumulation inside the sum; no atomics,
    # so deterministic), here or by the caller's next launch.
    return per_slot.view(T, K, H).sum(dim=1) if sum_slots else per_slot.view(T, K, H)


@torch.library.custom_op("zipmoe::fused_experts", mutates_args=())
def fused_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                  down: torch.Tensor) -> torch.Tensor:
    """Same contract as `fused_experts_reference`: x [T, H]; ids/weights [T, K]; gate_up [E, 2I, H];
    down [E, I, H] (contiguous) -> [T, H]."""
    return fused_experts_with_config(x, ids, weights, gate_up, down)


@fused_experts.register_fake
def _(x, ids, weights, gate_up, down):
    return torch.empty_like(x)


@torch.library.custom_op("zipmoe::fused_experts_per_slot", mutates_args=())
def fused_experts_per_slot(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                           down: torch.Tensor, distinct_ids: bool = False) -> torch.Tensor:
    """`fused_experts` without its last launch, the sum over each token's K slots: [T, K, H], each
    slot's expert output times its routing weight. The engine hands it to the next layer's input
    norm, which sums the slots in the same pass as the residual add. distinct_ids: as in
    `fused_experts_with_config`."""
    return fused_experts_with_config(x, ids, weights, gate_up, down, sum_slots=False, distinct_ids=distinct_ids)


@fused_experts_per_slot.register_fake
def _(x, ids, weights, gate_up, down, distinct_ids=False):
    return x.new_empty(x.shape[0], ids.shape[1], x.shape[1])
