"""The expert GEMMs' down half inside the fold's gate/up programs (`folded_router`, FUSED_DOWN).

Each gate/up program of `folded_router._routed_gate_up_kernel` holds SiLU(gate) * up for its
COLUMNS of one slot's expert and multiplies them by those columns' rows of the expert's [E, I, H]
down weight, adding the products, times the slot's weight, into the slot's float32 row (atomics;
the output projection's launch zeroed the rows). Two ways to run it:
- `down_into_slot`, after the gate/up loop (committed): a second loop over the down rows. Triton's
  pipeliner fills each loop on its own, so a program's first down rows are asked for only once its
  gate/up loop has ended, and every program of the launch reaches that point at about the same time.
- `gate_up_then_down` (`folded_router.DOWN_IN_LOOP`): one loop whose first steps are the gate/up
  GEMM's and whose later steps are the down GEMM's, so the pipeliner asks for the first down rows
  while the last gate/up rows are summed. Each step runs both kinds of step's arithmetic, the kind
  that is not its own on zeros or masked off (tensor-core work is not what bounds a batch-1 step).
"""
from __future__ import annotations

from .fused_moe import gate_up_pointers, gate_up_step, silu_mul

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
def slot_rows_add(act, w, acc_ptr, slot, weight, n0, H, live, BLOCK_M: tl.constexpr, ROWS: tl.constexpr,
                  PRECISION: tl.constexpr):
    """Rows [n0, n0 + ROWS) of act's row 0 times w, times the weight, added into the slot's row of acc
    (where `live`)."""
    n = n0 + tl.arange(0, ROWS)
    out = tl.sum(tl.where(tl.arange(0, BLOCK_M)[:, None] == 0, tl.dot(act, w, input_precision=PRECISION), 0.0), axis=0)
    tl.atomic_add(acc_ptr + slot * H + n, out * weight, mask=(n < H) & live, sem="relaxed")


@triton.jit
def down_into_slot(act, w_down, down_ptr, acc_ptr, expert, slot, weight, cols, col_real, H, I, BLOCK_M: tl.constexpr,
                   DOWN_AHEAD: tl.constexpr, DOWN_N: tl.constexpr, PRECISION: tl.constexpr):
    """This program's share of its slot's down GEMM, act [BLOCK_M, BLOCK_N] (row 0 the token's
    SiLU(gate) * up at `cols`, rounded as the hidden rows are stored) times the expert's down columns
    `cols` (w_down: its first DOWN_AHEAD rows, loaded before the gate/up loop), times the slot's
    weight, added (float32 atomics) into the slot's row of acc [K, H]. The slot's I / COLUMNS programs
    add into each element in no fixed order, so the sum's last bits may differ between runs."""
    if DOWN_AHEAD:
        slot_rows_add(act, w_down, acc_ptr, slot, weight, 0, H, True, BLOCK_M, DOWN_AHEAD, PRECISION)
    for n0 in range(DOWN_AHEAD, H, DOWN_N):
        w = down_columns(down_ptr, expert, cols, col_real, n0, H, I, DOWN_N)
        slot_rows_add(act, w, acc_ptr, slot, weight, n0, H, True, BLOCK_M, DOWN_N, PRECISION)


@triton.jit
def gate_up_then_down(y_ptr, w_ptr, down_ptr, acc_ptr, expert, slot, weight, inv, cols, col_real, H, I,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOWN_N: tl.constexpr,
                      PRECISION: tl.constexpr):
    """`down_into_slot` after the gate/up GEMM on y (its sums times inv), in one loop: cdiv(H, BLOCK_K)
    gate/up steps, then cdiv(H, DOWN_N) down steps. Every step asks for both kinds of tile, the kind
    that is not its own masked off (no memory read), so that each load has one use and Triton's
    pipeliner copies it ahead into shared memory."""
    ks = tl.arange(0, BLOCK_K)
    col_ok = col_real[None, :]
    dtype = y_ptr.dtype.element_ty
    w_gate, w_up = gate_up_pointers(w_ptr, expert, cols, H, I)
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    up_steps = tl.cdiv(H, BLOCK_K)
    for step in range(0, up_steps + tl.cdiv(H, DOWN_N)):
        down = step >= up_steps
        k0 = step * BLOCK_K  # the gate/up step's input columns k0 + ks
        n0 = (step - up_steps) * DOWN_N  # the down step's output rows n0 + [0, DOWN_N)
        up_width = tl.where(down, 0, H)  # no input column of a down step is read
        d = down_columns(down_ptr, expert, cols, col_real & down, n0, H, I, DOWN_N)
        acc_g, acc_u = gate_up_step(token_tile(y_ptr, k0, ks, up_width, BLOCK_M), w_gate, w_up, k0, ks, up_width,
                                    col_ok, acc_g, acc_u, PRECISION)
        act = silu_mul(acc_g * inv, acc_u * inv).to(dtype)  # final once the gate/up steps are done
        slot_rows_add(act, d, acc_ptr, slot, weight, n0, H, down, BLOCK_M, DOWN_N, PRECISION)
