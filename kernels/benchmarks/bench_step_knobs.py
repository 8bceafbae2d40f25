"""The decode step's graph replay under the knobs its kernels leave open, over the batches and
contexts each knob's choice depends on. A part of bench_kernels:

    python -m zipmoe.kernels.benchmarks.bench_kernels --parts step_knobs --out docs/results/step_knobs_h100
        [--knob-sets attention,merge,keys_ahead,splits,columns,tiles,out_proj,fused_down,ahead,refit,
         splits_large,out_proj_smem]

`bench_one_token` times the batch-1 step at one context; a knob whose best value may move with
the batch or the context length is chosen here. Each set times its variants in one engine, the
committed choices first and last (so drift shows), the graphs captured again for every variant;
every case routes the same prompts under every variant, so batches 16 and 64 read the same
expert union throughout.
- attention: the keys a tile of `paged_attention` (32, 64, 128) with and without the first tile
  loaded ahead of its PDL wait (`paged_attention.keys_ahead`), and the splits its last program
  merges a round (`MERGE_AT_ONCE`: 1, 4, 16); batches 1, 16 and 64, contexts of 256 to 4,096
  tokens.
- merge (batch 1, contexts of 300, 700 and 4,096 tokens: 5, 11 and 16 splits of 64-key tiles): the
  splits the attention's last program merges a round (`MERGE_AT_ONCE`: 4, 8, 16), where the attention
  set's 256 tokens use 4 splits, one round at each.
- keys_ahead: up to how many programs a multiprocessor the attention loads its first tile ahead
  (`KEYS_AHEAD_PER_SM`: 1, 2), the merge one split a round, and both as they were before session
  42 (keys ahead at every batch, one a round); batches 1, 4, 16 and 64.
- splits (batches 1, 4 and 16): at most how many splits the attention cuts a context into
  (`paged_attention.MAX_SPLITS`: 1 to 16; a split is whole tiles, so short contexts use fewer).
- qkv_tokens (batches 4 and 16): the one-launch q/k/v with its q/k norm, rotary and cache write
  (`qkv_norm_rope.QKV_MAX_T`) up to 16 tokens, against cuBLAS's GEMM and `qk_norm_rope_cache`.
- columns (batch 1, contexts 256 and 4,096): the gate/up columns a program of the fold takes
  (`folded_router.FOLD_COLUMNS`), spreading the launch evenly over the multiprocessors; beside
  them the down GEMM as its own launch without its loads ahead (result files before session 48 also
  time the experts' K tile at 256, now committed).
- tiles (batch 1, contexts 256 and 4,096): the fold's expert GEMM tiles and stages
  (`folded_router.pick_config`, FOLD_STAGES, both K tiles), the q/k/v launch's splits, warps and
  stages.
- out_proj (batch 1, the same contexts): the folded output projection's rows a program
  (`folded_router.OUT_PROJ_ROWS`: 1, 2, 4, 8) with half or all of their weights loaded ahead (the
  `columns` and `tiles` sets timed 2 and 8 rows before session 44: their result files name them).
- top_k (batch 1, the same contexts): the fold's gate/up K tile (`folded_router.FOLD_GATE_UP_BLOCK_K`,
  which keeps its programs at two a multiprocessor), beside 32 columns (the result files of session
  45 also time the top-K it replaced, ranks in one [E, E] pass, then a knob; those before session 52
  the down GEMM's K tile), and the gate/up programs' ranking block-wide as before session 51
  (`folded_router.RANK_IN_WARPS`).
- fused_down (batch 1, the same contexts): the down GEMM in the gate/up programs (committed), against
  its own launch (`folded_router.FUSED_DOWN` off), 128 rows a step of its loop (`DOWN_N`), 256 rows
  loaded before the gate/up loop (`DOWN_AHEAD`) and 32 columns a program.
- down (batch 1, the same contexts): the fold's down GEMM as its own launch (`FUSED_DOWN` off) at other
  tiles (its K tile, stages and columns, which set how many of its programs fit beside the gate/up's
  before that launch ends; result files before session 52 read the down weight as [E, H, I]).
- ahead (batch 1, the same contexts): the share of the down GEMM's (as its own launch) and the output
  projection's weights loaded ahead of their wait (half is committed, `dependent_launch.load_ahead`).
- splits_large (batches 16 and 64, contexts of 256 to 2,048 tokens): the attention's splits at the
  batches where its programs fill the GPU (`paged_attention.TARGET_PROGRAMS`: 256, 512, 1,024;
  MAX_SPLITS 2, 4; the result file of session 53's first run has 1, 2 and 4 splits and 512 and 2,048
  programs against 1,024).
- refit (batch 1, the same contexts): the knobs the down GEMM in the gate/up programs (session 52) may
  have moved: the fold's stages, the q/k/v launch's and the output projection's weights loaded ahead,
  the projection's rows a program, the q/k/v splits, the down rows a step and the merge's round (the
  result file of session 53 also times the slots' outputs summed into one float32 row, a knob since
  removed).
- out_proj_smem (batch 1, contexts 256 and 4,096): the output projection's launch in Gluon with its
  rows copied into shared memory before its wait (`folded_router.OUT_PROJ_SMEM`) at most 1, 2
  (committed) or 3 steps in flight a program, or all at once (`OUT_PROJ_SMEM_DEPTH`), against the
  Triton kernel (the result files of sessions 55 and 57 name the Triton kernel "committed").
Rows: bench "step_knob", impl "graph_replay", policy "<set>: <variant>", with `context` (the prompt).
"""
from __future__ import annotations

import dataclasses

import torch

from zipmoe.engine.routing import RoutingPolicy
from zipmoe.kernels import dependent_launch, folded_router, fused_moe, paged_attention, qkv_norm_rope
from zipmoe.kernels.fused_moe import MoeConfig

from .bench_kernels import decoding, drop, print_row, row
from .bench_one_token import capture_with, keys_a_tile
from .timing import cuda_time_us

BATCH_1 = ((1, 256), (1, 4096))


def _experts(block_n: int, block_k: int, warps: int, stages: int) -> list:
    """The fold's expert GEMMs, gate/up and down, at this tile shape (block_m 16: one token's slots)."""
    return [(folded_router, "pick_config", lambda *args: MoeConfig(16, block_n, block_k, warps, stages)),
            (folded_router, "FOLD_STAGES", stages), (folded_router, "FOLD_GATE_UP_BLOCK_K", block_k)]


def _unfused(*patches) -> list:
    """The fold's down GEMM as a launch of its own (`folded_router.FUSED_DOWN` off), with patches."""
    return [(folded_router, "FUSED_DOWN", False), *patches]


def _down(**tile) -> list:
    """The fold's down GEMM as its own launch at its config (`fused_moe.down_config`) with `tile`'s fields
    changed; its gate/up as committed."""
    def down_per_slot(hidden, down, weights, tile_slots, tile_expert, cfg, slot_tiles, ready=None):
        return fused_moe.down_per_slot(hidden, down, weights, tile_slots, tile_expert,
                                       dataclasses.replace(cfg, **tile), slot_tiles, ready)
    return _unfused((folded_router, "down_per_slot", down_per_slot))


def _ahead(width: int | None = None, share: float = 1.0):
    """An `ahead_width` that loads `width` columns ahead, or `share` of what the committed one does."""
    def ahead_width(columns: int, step: int) -> int:
        return width if width is not None else int(dependent_launch.ahead_width(columns, step) * share)
    return ahead_width


def knob_sets() -> dict[str, tuple[tuple, list]]:
    """{set: (cases (batch, prompt tokens), [(variant, patches)])}."""
    after = (paged_attention, "keys_ahead", False)
    return {
        "attention": (((1, 256), (1, 4096), (16, 256), (16, 2048), (64, 256), (64, 1024)), [
            ("committed (64 keys, first tile ahead where the launch fits at once)", []),
            ("128 keys, first tile ahead", [(paged_attention, "_tile_config", keys_a_tile(128))]),
            ("128 keys, after the wait", [(paged_attention, "_tile_config", keys_a_tile(128)), after]),
            ("64 keys, after the wait", [after]),
            ("32 keys, first tile ahead", [(paged_attention, "_tile_config", keys_a_tile(32))]),
            ("merge 4 splits a round", [(paged_attention, "MERGE_AT_ONCE", 4)]),
            ("merge 16 splits a round", [(paged_attention, "MERGE_AT_ONCE", 16)]),
            ("committed again", []),
        ]),
        "merge": (((1, 300), (1, 700), (1, 4096)), [
            ("committed (merge 4 splits a round)", []),
            *[(f"merge {n} splits a round", [(paged_attention, "MERGE_AT_ONCE", n)]) for n in (8, 16)],
            ("committed again", []),
        ]),
        "keys_ahead": (((1, 256), (1, 4096), (4, 256), (4, 2048), (16, 256), (16, 2048), (64, 256), (64, 1024)), [
            ("committed", []),
            ("keys ahead up to 1 program a multiprocessor", [(paged_attention, "KEYS_AHEAD_PER_SM", 1)]),
            ("merge 1 split a round", [(paged_attention, "MERGE_AT_ONCE", 1)]),
            ("keys ahead at every batch, merge 1 a round (before)",
             [(paged_attention, "KEYS_AHEAD_PER_SM", 1 << 30), (paged_attention, "MERGE_AT_ONCE", 1)]),
            ("committed again", []),
        ]),
        "splits": (((1, 256), (1, 4096), (4, 256), (16, 256)), [
            ("committed", []),
            *[(f"attention at most {n} splits", [(paged_attention, "MAX_SPLITS", n)]) for n in (1, 2, 4, 8)],
            ("committed again", []),
        ]),
        "qkv_tokens": (((4, 256), (16, 256), (16, 2048)), [
            ("committed (the one-launch q/k/v for 1 token, cuBLAS above)", []),
            ("the one-launch q/k/v up to 16 tokens", [(qkv_norm_rope, "QKV_MAX_T", 16)]),
            ("committed again", []),
        ]),
        "columns": (BATCH_1, [
            ("committed (gate/up 24 columns a program, 256 programs)", []),
            ("gate/up 32 columns a program (192 programs, before)", [(folded_router, "FOLD_COLUMNS", 0)]),
            ("gate/up 48 columns a program (128 programs)", [(folded_router, "FOLD_COLUMNS", 48)]),
            ("down GEMM its own launch, no loads ahead", _unfused((fused_moe, "ahead_width", _ahead(0)))),
            ("committed again", []),
        ]),
        "tiles": (BATCH_1, [
            ("committed", []),
            ("experts 16x32x128, 4 warps, 4 stages (the sweep's)", _experts(32, 128, 4, 4)),
            ("experts 16x32x128, 4 warps, 2 stages", _experts(32, 128, 4, 2)),
            ("experts 16x32x128, 8 warps, 3 stages", _experts(32, 128, 8, 3)),
            ("experts 16x64x128, 4 warps, 3 stages", _experts(64, 128, 4, 3)),
            ("experts 16x16x128, 4 warps, 3 stages (the down GEMM 1,024 programs)", _experts(16, 128, 4, 3)),
            ("q/k/v 4 splits", [(qkv_norm_rope, "QKV_MAX_SPLIT", 4)]),
            ("q/k/v 16 splits", [(qkv_norm_rope, "QKV_MAX_SPLIT", 16)]),
            ("q/k/v 2 warps", [(qkv_norm_rope, "QKV_WARPS", 2)]),
            ("q/k/v 8 warps", [(qkv_norm_rope, "QKV_WARPS", 8)]),
            ("q/k/v 1 stage", [(qkv_norm_rope, "QKV_STAGES", 1)]),
            ("committed again", []),
        ]),
        "out_proj": (BATCH_1, [
            ("committed (output projection 4 rows a program, half ahead)", []),
            ("2 rows, half ahead", [(folded_router, "OUT_PROJ_ROWS", 2)]),
            ("2 rows, all ahead",
             [(folded_router, "OUT_PROJ_ROWS", 2), (folded_router, "ahead_width", _ahead(share=2.0))]),
            ("1 row, half ahead", [(folded_router, "OUT_PROJ_ROWS", 1)]),
            ("1 row, all ahead",
             [(folded_router, "OUT_PROJ_ROWS", 1), (folded_router, "ahead_width", _ahead(share=2.0))]),
            ("8 rows, half ahead", [(folded_router, "OUT_PROJ_ROWS", 8)]),
            ("committed again", []),
        ]),
        "out_proj_smem": (BATCH_1, [
            ("committed (Gluon, the rows copied into shared memory, at most 2 steps in flight a program)", []),
            ("the Triton kernel, half the rows ahead in registers (before)", [(folded_router, "OUT_PROJ_SMEM", False)]),
            *[(f"Gluon, at most {depth} steps in flight a program", [(folded_router, "OUT_PROJ_SMEM_DEPTH", depth)])
              for depth in (1, 3)],
            ("Gluon, every step in flight", [(folded_router, "OUT_PROJ_SMEM_DEPTH", 0)]),
            ("committed again", []),
        ]),
        "top_k": (BATCH_1, [
            ("committed (gate/up K tile 256)", []),
            ("gate/up K tile 128 (the config's)", [(folded_router, "FOLD_GATE_UP_BLOCK_K", 0)]),
            ("gate/up K tile 256, 32 columns", [(folded_router, "FOLD_COLUMNS", 32)]),
            ("gate/up programs ranking block-wide (before session 51)", [(folded_router, "RANK_IN_WARPS", False)]),
            ("committed again", []),
        ]),
        "fused_down": (BATCH_1, [
            ("committed (the down GEMM in the gate/up programs, 256 rows a step)", []),
            ("the down GEMM its own launch (before session 52)", [(folded_router, "FUSED_DOWN", False)]),
            ("128 rows a step", [(folded_router, "DOWN_N", 128)]),
            ("256 rows a step, 256 before the gate/up loop", [(folded_router, "DOWN_AHEAD", 256)]),
            ("256 rows a step, 32 columns", [(folded_router, "FOLD_COLUMNS", 32)]),
            ("committed again", []),
        ]),
        "down": (BATCH_1, [
            ("committed (the down GEMM in the gate/up programs)", []),
            ("its own launch (down 16x128x64, 3 stages, 128 programs)", _down()),
            ("its own launch, K tile 32", _down(block_k=32)),
            ("down 2 stages", _down(num_stages=2)),
            ("down 4 stages", _down(num_stages=4)),
            ("down 64 columns (256 programs)", _down(block_n=64)),
            ("down 256 columns (64 programs)", _down(block_n=256)),
            ("committed again", []),
        ]),
        "ahead": (BATCH_1, [
            ("committed", []),
            ("down GEMM its own launch, 512 of 768 rows ahead", _unfused((fused_moe, "ahead_width", _ahead(512)))),
            ("down GEMM its own launch, one step (64 rows) ahead", _unfused((fused_moe, "ahead_width", _ahead(64)))),
            ("output projection a quarter ahead", [(folded_router, "ahead_width", _ahead(share=0.5))]),
            ("output projection all ahead", [(folded_router, "ahead_width", _ahead(share=2.0))]),
            ("committed again", []),
        ]),
        "splits_large": (((16, 256), (16, 2048), (64, 256), (64, 1024)), [
            ("committed (512 programs, at most 16 splits)", []),
            ("attention 1,024 programs (before session 53)", [(paged_attention, "TARGET_PROGRAMS", 1024)]),
            ("attention 256 programs", [(paged_attention, "TARGET_PROGRAMS", 256)]),
            *[(f"attention at most {n} splits", [(paged_attention, "MAX_SPLITS", n)]) for n in (2, 4)],
            ("committed again", []),
        ]),
        "refit": (BATCH_1, [
            ("committed", []),
            ("fold 2 stages", [(folded_router, "FOLD_STAGES", 2)]),
            ("fold 4 stages", [(folded_router, "FOLD_STAGES", 4)]),
            ("q/k/v none ahead", [(qkv_norm_rope, "ahead_width", _ahead(0))]),
            ("q/k/v all ahead", [(qkv_norm_rope, "ahead_width", _ahead(256))]),
            ("output projection a quarter ahead", [(folded_router, "ahead_width", _ahead(share=0.5))]),
            ("output projection all ahead", [(folded_router, "ahead_width", _ahead(share=2.0))]),
            ("output projection 2 rows", [(folded_router, "OUT_PROJ_ROWS", 2)]),
            ("q/k/v 4 splits", [(qkv_norm_rope, "QKV_MAX_SPLIT", 4)]),
            ("q/k/v 16 splits", [(qkv_norm_rope, "QKV_MAX_SPLIT", 16)]),
            ("down 512 rows a step", [(folded_router, "DOWN_N", 512)]),
            ("merge 8 splits a round", [(paged_attention, "MERGE_AT_ONCE", 8)]),
            ("committed again", []),
        ]),
    }


def bench_step_knobs(engine, sets: list[str]) -> list[dict]:
    """Graph replay of the step under every variant of each named set, over its cases."""
    rows = []
    for name in sets:
        cases, variants = knob_sets()[name]
        for variant, patches in variants:
            capture_with(engine, patches, True, RoutingPolicy())
            for batch, prompt in cases:
                g = torch.Generator().manual_seed(batch * 100_000 + prompt)  # the same prompts for every variant
                seqs = decoding(engine, [torch.randint(0, 150000, (prompt,), generator=g).tolist()
                                         for _ in range(batch)], max_tokens=40)
                graphs = engine.runner.graphs
                us = cuda_time_us(graphs.graphs[graphs.bucket(batch)].replay, warmup=3, reps=20)
                rows.append(row("step_knob", "graph_replay", batch, us, 0, f"{name}: {variant}", context=prompt))
                print_row(rows[-1])
                drop(engine, seqs)
    engine.set_routing_policy(RoutingPolicy())
    return rows
