"""The q/k/v projection's finish: its splits summed, the layer's input norm applied, the per-head q/k
RMSNorm and the rotary embedding. Shared by the two kernels that finish heads:
- `qkv_norm_rope._qkv_norm_rope_kernel`: the last program of each head to check in finishes that
  head and stores it (q into its output, k and v into the cache);
- `paged_attention._partition_kernel` with FINISH_QKV (`qkv_norm_rope.QKV_FINISH_IN_ATTENTION`, one
  decode token): the q/k/v launch only stores its float32 partials and its splits' sums of squares,
  and each attention program finishes its own group's q heads, key and value after its wait
  (`finish_group`). That takes the q/k/v launch's check-in and its last programs' reads off the
  step's critical path, at the price of each attention program reading its group's partials from L2
  (10 heads x 8 splits x 512 B at Qwen3-30B-A3B's shape).

Rounding as the references round (`layer_ops.qk_norm_rope_cache_reference`): the projection's
output rounded to the model's dtype, normalised in float32, rounded, times the weight, rounded, then
the rotation with each product rounded.
"""
from __future__ import annotations

from .arrivals import sum_splits
from .layer_ops import inverse_rms_of_squares

import triton  # after zipmoe.kernels (the package) chose the interpreter on CPU-only machines
import triton.language as tl


@triton.jit
def norm_rope_rows(x, w, cos, sin, eps, R: tl.constexpr, D: tl.constexpr):
    """Each row of x [R, D] (the model's dtype) RMS-normed times w, then rotated by cos / sin (which
    broadcast against x, float32): the heads' q or k as the model's dtype."""
    dtype = x.dtype
    xr = x.to(tl.float32)
    inv = tl.rsqrt(tl.sum(xr * xr, axis=1) / D + eps)[:, None]
    xn = (w * (xr * inv).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    # The rotate-half partner of column d is column (d + D/2) % D of the same normed row: its two
    # halves swapped in registers, not read again.
    pn = tl.reshape(tl.flip(tl.reshape(xn, [R, 2, D // 2]), 1), [R, D])
    rotated = tl.where(tl.arange(0, D)[None, :] < D // 2, -pn, pn)
    return ((xn * cos).to(dtype).to(tl.float32) + (rotated * sin).to(dtype).to(tl.float32)).to(dtype)


@triton.jit
def finish_group(part_ptr, squares_ptr, qn_ptr, kn_ptr, cos_ptr, sin_ptr, kv_head, kv_heads, hidden, splits, eps,
                 dtype: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, D: tl.constexpr,
                 MAX_SPLIT: tl.constexpr):
    """One token's q heads of a GQA group [GROUP_PAD, D] (rows past GROUP zero), its key and its
    value [1, D], finished from the q/k/v launch's float32 partials [splits, (Hq + 2 Hkv) * D] and
    sums of squares [heads, MAX_SPLIT] (every head's splits cover the same input columns: head 0's
    are read). Every load is independent: one wait on L2."""
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, D)
    width = (GROUP + 2) * kv_heads * D
    q_at = part_ptr + (kv_head * GROUP + g)[:, None] * D + d[None, :]
    q32 = sum_splits(q_at, width, splits, (g < GROUP)[:, None], MAX_SPLIT)
    row = (d < D)[None, :]  # all of a key's or value's columns
    k32 = sum_splits(part_ptr + ((GROUP * kv_heads + kv_head) * D + d)[None, :], width, splits, row, MAX_SPLIT)
    v32 = sum_splits(part_ptr + (((GROUP + 1) * kv_heads + kv_head) * D + d)[None, :], width, splits, row,
                     MAX_SPLIT)
    s = tl.arange(0, MAX_SPLIT)
    total = tl.sum(tl.load(squares_ptr + s, mask=s < splits, other=0.0, cache_modifier=".cg"), axis=0)
    inv = inverse_rms_of_squares(total, hidden, eps)
    cos = tl.load(cos_ptr + d)[None, :].to(tl.float32)
    sin = tl.load(sin_ptr + d)[None, :].to(tl.float32)
    q = norm_rope_rows((q32 * inv).to(dtype), tl.load(qn_ptr + d)[None, :].to(tl.float32), cos, sin, eps,
                       GROUP_PAD, D)
    k = norm_rope_rows((k32 * inv).to(dtype), tl.load(kn_ptr + d)[None, :].to(tl.float32), cos, sin, eps, 1, D)
    return q, k, (v32 * inv).to(dtype)
