"""The align step of the fused MoE kernels (`fused_moe.py`): a decode batch's slots (token, rank),
grouped by expert into tiles of BLOCK_M rows, as the expert GEMMs' programs take them.

Everything has a fixed shape given (slots, experts, BLOCK_M): `num_tiles` bounds the tile count,
tiles past the used ones have expert -1, and nothing is read back to the host, so the step can be
captured in a CUDA graph. `moe_align` is one Triton launch up to ALIGN_MAX_SLOTS slots and
`moe_align_reference` (device ops, a sort) above it and as the tests' reference. Called by
`fused_moe.fused_experts_with_config`; the tiles go to its gate/up and down launches.
"""
from __future__ import annotations

import torch

from .dependent_launch import launch_options, wait_for_inputs

import triton  # after zipmoe.kernels (the package) chose the interpreter on CPU-only machines
import triton.language as tl

# The aligner (a program per expert, each over the whole slot list) handles up to this many slots:
# a decode batch of 128 x top-8 is 1,024, a 1,024-token prefill chunk 8,192. Above it the reference
# runs: about fifteen launches and a sort, whose host cost an eager prefill step pays every layer.
ALIGN_MAX_SLOTS = 8192


def num_tiles(num_slots: int, num_experts: int, block_m: int) -> int:
    """Upper bound on tiles: each used expert wastes less than one tile of padding."""
    return min(num_experts, num_slots) + triton.cdiv(num_slots, block_m)


def moe_align_reference(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [T, K] -> (tile_slots int32 [G * block_m], tile_expert int32 [G]).

    Tiles hold the slots (t * K + k) of one expert in ascending order, padded with S (= T*K);
    experts in ascending order; unused tiles have expert -1. Device ops only, no host sync.
    """
    flat = ids.reshape(-1)
    S = flat.numel()
    G = num_tiles(S, num_experts, block_m)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=ids.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    tiles = (counts + block_m - 1) // block_m
    tile_end = tiles.cumsum(0)
    tile_expert = torch.searchsorted(tile_end, torch.arange(G, device=ids.device), right=True)
    tile_expert = torch.where(tile_expert < num_experts, tile_expert, -1).to(torch.int32)
    order = torch.argsort(flat, stable=True)
    by_expert = flat[order]
    rank = torch.arange(S, device=ids.device) - (counts.cumsum(0) - counts)[by_expert]
    dest = (tile_end - tiles)[by_expert] * block_m + rank
    tile_slots = torch.full((G * block_m,), S, dtype=torch.int32, device=ids.device)
    tile_slots[dest] = order.to(torch.int32)
    return tile_slots, tile_expert


@triton.jit
def _align_kernel(ids_ptr, tile_slots_ptr, tile_expert_ptr, S, E, G,
                  BLOCK_M: tl.constexpr, E_PAD: tl.constexpr, S_PAD: tl.constexpr, T_PAD: tl.constexpr,
                  G_PAD: tl.constexpr, PAD_CHUNK: tl.constexpr, PDL: tl.constexpr):
    # One program per expert, each reading the whole slot list (S is at most a few thousand ids, one
    # vector): a histogram gives every expert's count, hence this expert's first tile; a prefix sum of
    # "slot is mine" gives each of its slots' rank. No program waits on another, so the step costs one
    # short pass instead of a serial walk over the slots (a single program over 64-slot chunks took
    # 35 us at 64 tokens and 65 us at 128 on the H200, 13 % of a batch-64 decode step).
    wait_for_inputs(PDL)
    e = tl.program_id(0)
    slot = tl.arange(0, S_PAD)
    ids = tl.load(ids_ptr + slot, mask=slot < S, other=E).to(tl.int32)  # padding lanes land in bin E
    experts = tl.arange(0, E_PAD)
    counts = tl.where(experts < E, tl.histogram(ids, E_PAD), 0)
    tiles = (counts + BLOCK_M - 1) // BLOCK_M
    tile_end = tl.cumsum(tiles, axis=0)
    mine = experts == e
    my_tiles = tl.sum(tl.where(mine, tiles, 0))
    my_count = tl.sum(tl.where(mine, counts, 0))
    first = tl.sum(tl.where(mine, tile_end, 0)) - my_tiles
    hit = ids == e
    rank = tl.cumsum(hit.to(tl.int32), axis=0) - 1
    tl.store(tile_slots_ptr + first * BLOCK_M + rank, slot, mask=hit)
    lane = tl.arange(0, BLOCK_M)  # only this expert's last tile has padding: its lanes past the count
    last = (my_tiles - 1) * BLOCK_M + lane
    tl.store(tile_slots_ptr + first * BLOCK_M + last, tl.full([BLOCK_M], 0, tl.int32) + S,
             mask=(my_tiles > 0) & (last >= my_count))
    t = tl.arange(0, T_PAD)
    tl.store(tile_expert_ptr + first + t, tl.full([T_PAD], 0, tl.int32) + e, mask=t < my_tiles)
    if e == 0:  # the tiles after the last expert's are unused: expert -1, slots all padding
        used = tl.sum(tiles)
        g = used + tl.arange(0, G_PAD)
        tl.store(tile_expert_ptr + g, tl.full([G_PAD], -1, tl.int32), mask=g < G)
        chunk = tl.arange(0, PAD_CHUNK)
        for p0 in range(used * BLOCK_M, G * BLOCK_M, PAD_CHUNK):
            tl.store(tile_slots_ptr + p0 + chunk, tl.full([PAD_CHUNK], 0, tl.int32) + S,
                     mask=p0 + chunk < G * BLOCK_M)


def moe_align(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Same result as `moe_align_reference`; one launch for decode-sized batches."""
    S = ids.numel()
    if S > ALIGN_MAX_SLOTS:
        return moe_align_reference(ids, num_experts, block_m)
    G = num_tiles(S, num_experts, block_m)
    tile_slots = torch.empty(G * block_m, dtype=torch.int32, device=ids.device)
    tile_expert = torch.empty(G, dtype=torch.int32, device=ids.device)
    _align_kernel[(num_experts,)](ids.reshape(-1), tile_slots, tile_expert, S, num_experts, G,
                                 BLOCK_M=block_m, E_PAD=triton.next_power_of_2(num_experts + 1),
                                 S_PAD=triton.next_power_of_2(S), T_PAD=triton.next_power_of_2(triton.cdiv(S, block_m)),
                                 G_PAD=triton.next_power_of_2(G), PAD_CHUNK=256, num_warps=4 if S <= 1024 else 16,
                                 **launch_options(ids.device))
    return tile_slots, tile_expert
