"""The expert GEMMs' down half inside the fold's gate/up programs (`folded_router`, FUSED_DOWN).

Each gate/up program of `folded_router._routed_gate_up_kernel` holds SiLU(gate) * up for its
COLUMNS of one slot's expert and multiplies them by those columns' rows of the expert's [E, I, H]
down weight, adding the products, times the slot's weight, into the slot's float32 row (atomics;
the output projection's launch zeroed the rows): `down_into_slot`, a second loop after the gate/up
loop. (One loop of gate/up steps then down steps, each step asking for both kinds of tile with the
other kind masked off so that Triton's pipeliner copies all four ahead, was 11-14 % slower in the
batch-1 step: session 57, H100.)
"""
from __future__ import annotations

import triton  # after zipmoe.kernels (the package) chose the interpreter on CPU-only machines
import triton.language as tl


@triton.jit
def token_tile(y_ptr, k0, ks, H, BLOCK_M: tl.constexpr):
    """The token's inputs y[k0 + ks] (those below H) as row 0 of a [BLOCK_M, len(ks)] tile, tl.dot's
    fewest rows; the other rows are zeros."""
    m = tl.arange(0, BLOCK_M)
    return tl.load(y_ptr + m[:, None] * 0 + k0 + ks[None, :], mask=(m[:, None] == 0) & (k0 + ks < H)[None, :],
                   other=0.0)


@triton.jit
def down_columns(down_ptr, expert, cols, col_real, n0, H, I, ROWS: tl.constexpr):
    """Rows [n0, n0 + ROWS) of the expert's down weight at columns `cols`, as [BLOCK_N, ROWS]."""
    n = n0 + tl.arange(0, ROWS)
    return tl.load(down_ptr + expert * I * H + cols[:, None].to(tl.int64) * H + n[None, :],
                   mask=col_real[:, None] & (n < H)[None, :], other=0.0)


@triton.jit
def slot_rows_add(act, w, acc_ptr, slot, weight, n0, H, BLOCK_M: tl.constexpr, ROWS: tl.constexpr,
                  PRECISION: tl.constexpr):
    """Rows [n0, n0 + ROWS) of act's row 0 times w, times the weight, added into the slot's row of acc."""
    n = n0 + tl.arange(0, ROWS)
    out = tl.sum(tl.where(tl.arange(0, BLOCK_M)[:, None] == 0, tl.dot(act, w, input_precision=PRECISION), 0.0), axis=0)
    tl.atomic_add(acc_ptr + slot * H + n, out * weight, mask=n < H, sem="relaxed")


@triton.jit
def down_into_slot(act, w_down, down_ptr, acc_ptr, expert, slot, weight, cols, col_real, H, I, BLOCK_M: tl.constexpr,
                   DOWN_AHEAD: tl.constexpr, DOWN_N: tl.constexpr, PRECISION: tl.constexpr):
    """This program's share of its slot's down GEMM, act [BLOCK_M, BLOCK_N] (row 0 the token's
    SiLU(gate) * up at `cols`, rounded as the hidden rows are stored) times the expert's down columns
    `cols` (w_down: its first DOWN_AHEAD rows, loaded before the gate/up loop), times the slot's
    weight, added (float32 atomics) into the slot's row of acc [K, H]. The slot's I / COLUMNS programs
    add into each element in no fixed order, so the sum's last bits may differ between runs."""
    if DOWN_AHEAD:
        slot_rows_add(act, w_down, acc_ptr, slot, weight, 0, H, BLOCK_M, DOWN_AHEAD, PRECISION)
    for n0 in range(DOWN_AHEAD, H, DOWN_N):
        w = down_columns(down_ptr, expert, cols, col_real, n0, H, I, DOWN_N)
        slot_rows_add(act, w, acc_ptr, slot, weight, n0, H, BLOCK_M, DOWN_N, PRECISION)

