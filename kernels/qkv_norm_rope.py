"""The attention's q/k/v projection with the per-head q/k RMSNorm, the rotary embedding and the
K/V cache write in one launch, beside its PyTorch reference.

At decode batch sizes the projection is a GEMV over a 5120 x 2048 bf16 weight at Qwen3-30B-A3B's
shape (21 MB, 5.0 us at an H200's copy speed). cuBLAS ran it in 7.7 us a layer at batch 1 (session
18's profile) and `layer_ops.qk_norm_rope_cache` took a second launch (1.4 us). Here a program per
(head, split of the input width) sums its share of one head's 128 output columns in float32; the
last program of the head to check in (`kernels/arrivals.py`) adds the splits up, rounds them to the
model dtype as F.linear rounds its output, and does `qk_norm_rope_cache`'s work on the head: q
normed and rotated into the output, k normed and rotated into the cache, v copied into it. One
launch where there were two, up to 16 tokens; the engine takes it where it was measured faster
(QKV_MAX_T), cuBLAS's GEMM and `qk_norm_rope_cache` elsewhere. Each program loads the first
half of its weights before it waits for the launch before (`dependent_launch.load_ahead`); with
the folded output projection doing the same, the batch-1 step is 3 % faster (H100, session 37).

For one token the launch also takes the layer's input norm in (`add_norm_qkv`): each program adds
the residual stream and the MoE layer's slot outputs for its share of the input width, and runs
its GEMV on g * (h + delta) (g the norm's weight) with the share's sum of squares beside it. The
norm's 1 / RMS is one number for the whole row, so the last program of a head applies it to the
summed splits, from the splits' sums of squares: no program reads the whole row before its first
weight load (as each once did, 36 kB from L2 at the 30B shape). One launch fewer a layer: the
step was 80-95 us faster at batch 1 than with `layer_ops.add_rms_norm` apart (session 30). The
norm's output is not rounded to the model's dtype before the GEMV, as the reference rounds it:
the results differ from it by that rounding.

Called by `engine/model.py` at the start of each layer's attention: `ops.add_norm_qkv` after the
layer before, `ops.qkv_norm_rope_cache` for the first layer and steps with DeepStack features.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .arrivals import arrival_counters, last_to_arrive, split_width, sum_splits
from .dependent_launch import ahead_width, launch_options, wait_for_inputs
from .layer_ops import (add_rms_norm, add_rms_norm_reference, inverse_rms_of_squares, qk_norm_rope_cache,
                        qk_norm_rope_cache_reference, residual_sum, weighted)

import triton  # after zipmoe.kernels (the package) chose the interpreter on CPU-only machines
import triton.language as tl

QKV_BLOCK_T = 16  # token rows of a program's tile (tl.dot's smallest); also the most it serves
# `qkv_norm_rope_cache` takes the one launch up to this many tokens, cuBLAS's GEMM and
# `qk_norm_rope_cache` above. Session 19 (`bench_kernels --parts qkv`, per layer): 9.4 against 9.7 us
# at one token, but 10.4 / 12.8 against 9.8 / 10.2 at 4 and 16.
QKV_MAX_T = 1
QKV_BLOCK_K = 128  # input columns per loop iteration
QKV_MAX_SPLIT = 8  # splits of the input width per head: 40 heads x 8 = 320 programs at the 30B shape
QKV_MAX_HEADS = 1024  # q + k + v heads one launch serves: one arrival counter each
QKV_WARPS = 4  # 2 and 8 made the batch-1 step 5 % slower (H100, session 38: bench_step_knobs)
QKV_STAGES = 2  # 2 iterations a program at the 30B shape: 2 stages, half the shared memory (1: even)


def qkv_norm_rope_cache_reference(x: torch.Tensor, weight: torch.Tensor, q_norm: torch.Tensor, k_norm: torch.Tensor,
                                  cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                  slots: torch.Tensor, eps: float, num_heads: int, num_kv_heads: int) -> torch.Tensor:
    """x [T, hidden], weight [(Hq + 2 Hkv) * D, hidden] -> `qk_norm_rope_cache_reference` of x @ weight.T."""
    return qk_norm_rope_cache_reference(F.linear(x, weight), q_norm, k_norm, cos, sin, k_cache, v_cache, slots, eps,
                                        num_heads, num_kv_heads)


@triton.jit
def _qkv_step(ws, k, acc, squares, x_ptr, h_ptr, delta_ptr, norm_ptr, h_out_ptr, rows, head, T, K,
              ADD_NORM: tl.constexpr, SLOTS: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """One step over input columns k of a split: acc += x[:, k] ws.T, where x is the token rows, or
    one token's g * (h + delta) (ADD_NORM: squares += the sum of (h + delta)^2; head 0 stores h + delta)."""
    if ADD_NORM:
        res_part = residual_sum(h_ptr, delta_ptr, k, k < K, K, SLOTS)
        if head == 0:
            tl.store(h_out_ptr + k, res_part, mask=k < K)
        r32 = res_part.to(tl.float32)
        squares += tl.sum(r32 * r32, axis=0)
        x_part = weighted(res_part, tl.load(norm_ptr + k, mask=k < K, other=0.0))
        xs = tl.where(rows[:, None] == 0, x_part.to(tl.float32)[None, :], 0.0).to(x_part.dtype)
    else:
        xs = tl.load(x_ptr + rows[:, None] * K + k[None, :], mask=(rows[:, None] < T) & (k[None, :] < K), other=0.0)
    return acc + tl.dot(xs, tl.trans(ws), input_precision=DOT_PRECISION), squares


@triton.jit
def _qkv_norm_rope_kernel(x_ptr, w_ptr, partial_ptr, squares_ptr, arrivals_ptr, qn_ptr, kn_ptr, cos_ptr, sin_ptr,
                          kc_ptr, vc_ptr, slots_ptr, q_out_ptr, h_ptr, delta_ptr, norm_ptr, h_out_ptr, T, K,
                          K_PER_SPLIT, eps, HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
                          BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, MAX_SPLIT: tl.constexpr,
                          ADD_NORM: tl.constexpr, SLOTS: tl.constexpr, DOT_PRECISION: tl.constexpr,
                          FIRST: tl.constexpr, LOAD_AHEAD: tl.constexpr, PDL: tl.constexpr):
    head, split, split_count = tl.program_id(0), tl.program_id(1), tl.num_programs(1)
    NCOLS: tl.constexpr = (HQ + 2 * HKV) * D
    HALF: tl.constexpr = D // 2
    rows = tl.arange(0, BLOCK_T).to(tl.int64)
    d = tl.arange(0, D)
    cols = head * D + d
    # One token (ADD_NORM): the GEMV runs on g * (h + delta) (delta: the MoE layer's SLOTS slot
    # outputs, summed on the way, as `layer_ops.add_rms_norm` sums them), its 1 / RMS applied after
    # the splits are summed; the first head's programs store their columns of h + delta (h_out).
    squares = 0.0
    acc = tl.zeros([BLOCK_T, D], dtype=tl.float32)
    start = split * K_PER_SPLIT
    end = tl.minimum(start + K_PER_SPLIT, K)
    w_rows = w_ptr + cols[:, None].to(tl.int64) * K
    # The split's first FIRST columns in one step; LOAD_AHEAD: their weights loaded ahead of the wait
    # (no kernel before writes them), while the launch before still runs.
    first = start + tl.arange(0, FIRST)
    if not LOAD_AHEAD:
        wait_for_inputs(PDL)
    w_first = tl.load(w_rows + first[None, :], mask=first[None, :] < K, other=0.0)
    if LOAD_AHEAD:
        wait_for_inputs(PDL)
    acc, squares = _qkv_step(w_first, first, acc, squares, x_ptr, h_ptr, delta_ptr, norm_ptr, h_out_ptr, rows, head,
                             T, K, ADD_NORM, SLOTS, DOT_PRECISION)
    for k0 in range(start + FIRST, end, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        ws = tl.load(w_rows + k[None, :], mask=k[None, :] < K, other=0.0)
        acc, squares = _qkv_step(ws, k, acc, squares, x_ptr, h_ptr, delta_ptr, norm_ptr, h_out_ptr, rows, head, T, K,
                                 ADD_NORM, SLOTS, DOT_PRECISION)
    row_ok = rows[:, None] < T
    tl.store(partial_ptr + (split * T + rows[:, None]) * NCOLS + cols[None, :], acc, mask=row_ok)
    if ADD_NORM:
        tl.store(squares_ptr + head * MAX_SPLIT + split, squares)
    # What the head's last step reads besides the partials, asked for by every program before it
    # checks in: in flight during the check-in, where the last program, asking after it, waited on
    # L2 once for them and once more behind each of the norm's reductions. A v head reads the slot
    # only; a q or k head its own norm's weight.
    slot = tl.load(slots_ptr + rows, mask=rows < T, other=0).to(tl.int64)
    normed = head < HQ + HKV
    w = tl.load(tl.where(head < HQ, qn_ptr, kn_ptr) + d[None, :], mask=normed, other=0.0).to(tl.float32)
    cos = tl.load(cos_ptr + rows[:, None] * D + d[None, :], mask=row_ok & normed, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + rows[:, None] * D + d[None, :], mask=row_ok & normed, other=0.0).to(tl.float32)
    if last_to_arrive(arrivals_ptr + head, split_count):
        x32 = sum_splits(partial_ptr, rows, cols, T, NCOLS, split_count, row_ok, MAX_SPLIT)
        if ADD_NORM:  # the norm's 1 / RMS, from the head's splits' sums of squares (they cover the row)
            s = tl.arange(0, MAX_SPLIT)
            total = tl.sum(tl.load(squares_ptr + head * MAX_SPLIT + s, mask=s < split_count, other=0.0,
                                   cache_modifier=".cg"), axis=0)
            x32 = x32 * inverse_rms_of_squares(total, K, eps)
        dtype = q_out_ptr.dtype.element_ty
        x = x32.to(dtype)  # the projection's output, rounded as F.linear rounds it
        if not normed:  # v: copied into the cache as is
            tl.store(vc_ptr + (slot[:, None] * HKV + head - HQ - HKV) * D + d[None, :], x, mask=row_ok)
        else:
            xr = x.to(tl.float32)
            inv = tl.rsqrt(tl.sum(xr * xr, axis=1) / D + eps)[:, None]
            # Round where PyTorch rounds, as qk_norm_rope_cache does: normalise (f32) -> dtype,
            # * weight -> dtype, then the rotation.
            xn = (w * (xr * inv).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
            # The rotate-half partner of column d is column (d + D/2) % D of the same normed head:
            # its two halves swapped in registers, not read again.
            pn = tl.reshape(tl.flip(tl.reshape(xn, [BLOCK_T, 2, HALF]), 1), [BLOCK_T, D])
            rotated = tl.where(d[None, :] < HALF, -pn, pn)
            out = ((xn * cos).to(dtype).to(tl.float32) + (rotated * sin).to(dtype).to(tl.float32)).to(dtype)
            if head < HQ:
                tl.store(q_out_ptr + (rows[:, None] * HQ + head) * D + d[None, :], out, mask=row_ok)
            else:
                tl.store(kc_ptr + (slot[:, None] * HKV + head - HQ) * D + d[None, :], out, mask=row_ok)


def fused_qkv_norm_rope_cache(x: torch.Tensor, weight: torch.Tensor, q_norm: torch.Tensor, k_norm: torch.Tensor,
                              cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              slots: torch.Tensor, eps: float, num_heads: int, num_kv_heads: int,
                              norm_inputs=None) -> torch.Tensor:
    """`qkv_norm_rope_cache_reference`'s contract in one launch, up to QKV_BLOCK_T tokens.
    norm_inputs (h, delta, norm weight, h_out): one token whose x the kernel makes itself
    (`fused_add_norm_qkv`); x is then only its shape and dtype."""
    T, K = x.shape
    D = q_norm.shape[0]
    heads = num_heads + 2 * num_kv_heads
    if T > QKV_BLOCK_T:
        raise ValueError(f"fused_qkv_norm_rope_cache serves at most {QKV_BLOCK_T} tokens, got {T}")
    if D & (D - 1) or D < 16:
        raise ValueError(f"head_dim {D} must be a power of two, at least 16")
    if heads > QKV_MAX_HEADS or tuple(weight.shape) != (heads * D, K):
        raise ValueError(f"weight {tuple(weight.shape)}: not {heads} heads of {D} over {K} inputs "
                         f"(at most {QKV_MAX_HEADS} heads)")
    if x.dtype != weight.dtype:
        raise ValueError(f"x and weight must share a dtype, got {x.dtype} and {weight.dtype}")
    q = torch.empty(T, num_heads, D, dtype=x.dtype, device=x.device)
    if T:
        split = max(1, min(QKV_MAX_SPLIT, triton.cdiv(K, QKV_BLOCK_K)))
        k_per_split = split_width(K, split, QKV_BLOCK_K)
        ahead = ahead_width(k_per_split, QKV_BLOCK_K)
        partial = torch.empty(split, T, heads * D, dtype=torch.float32, device=x.device)
        squares = torch.empty(heads, QKV_MAX_SPLIT, dtype=torch.float32, device=x.device) if norm_inputs else partial
        h, delta, norm, h_out = norm_inputs or (x, x, x, x)
        _qkv_norm_rope_kernel[(heads, split)](
            x.contiguous(), weight.contiguous(), partial, squares,
            arrival_counters("qkv_norm_rope", x.device, QKV_MAX_HEADS),
            q_norm, k_norm, cos.contiguous(), sin.contiguous(), k_cache, v_cache, slots, q, h, delta, norm, h_out,
            T, K, k_per_split, eps, HQ=num_heads, HKV=num_kv_heads, D=D, BLOCK_T=QKV_BLOCK_T, BLOCK_K=QKV_BLOCK_K,
            MAX_SPLIT=QKV_MAX_SPLIT, ADD_NORM=norm_inputs is not None,
            SLOTS=delta.shape[1] if delta.dim() == 3 else 1,
            # float32 (tests, the CPU reference's dtype) as F.linear computes it, not in TF32
            DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
            num_warps=QKV_WARPS, num_stages=QKV_STAGES,
            FIRST=ahead or QKV_BLOCK_K, LOAD_AHEAD=ahead > 0, **launch_options(x.device))
    return q


@torch.library.custom_op("zipmoe::qkv_norm_rope_cache", mutates_args=("k_cache", "v_cache"))
def qkv_norm_rope_cache(x: torch.Tensor, weight: torch.Tensor, q_norm: torch.Tensor, k_norm: torch.Tensor,
                        cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        slots: torch.Tensor, eps: float, num_heads: int, num_kv_heads: int) -> torch.Tensor:
    """Same contract as `qkv_norm_rope_cache_reference`: `fused_qkv_norm_rope_cache` up to QKV_MAX_T
    tokens, the GEMM then `qk_norm_rope_cache` above."""
    if x.shape[0] > QKV_MAX_T:
        return qk_norm_rope_cache(F.linear(x, weight), q_norm, k_norm, cos, sin, k_cache, v_cache, slots, eps,
                                  num_heads, num_kv_heads)
    return fused_qkv_norm_rope_cache(x, weight, q_norm, k_norm, cos, sin, k_cache, v_cache, slots, eps, num_heads,
                                     num_kv_heads)


@qkv_norm_rope_cache.register_fake
def _(x, weight, q_norm, k_norm, cos, sin, k_cache, v_cache, slots, eps, num_heads, num_kv_heads):
    return x.new_empty(x.shape[0], num_heads, q_norm.shape[0])


def add_norm_qkv_reference(h: torch.Tensor, delta: torch.Tensor, norm: torch.Tensor, weight: torch.Tensor,
                           q_norm: torch.Tensor, k_norm: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                           k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, eps: float,
                           num_heads: int, num_kv_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's start: (h + delta, q) with q as `qkv_norm_rope_cache_reference` gives it for
    x = rms_norm(h + delta); delta [T, H], or [T, K, H] (the MoE layer before's slot outputs)."""
    h, x = add_rms_norm_reference(h, delta, norm, eps)
    return h, qkv_norm_rope_cache_reference(x, weight, q_norm, k_norm, cos, sin, k_cache, v_cache, slots, eps,
                                            num_heads, num_kv_heads)


@torch.library.custom_op("zipmoe::fused_add_norm_qkv", mutates_args=("k_cache", "v_cache"))
def fused_add_norm_qkv(h: torch.Tensor, delta: torch.Tensor, norm: torch.Tensor, weight: torch.Tensor,
                       q_norm: torch.Tensor, k_norm: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, eps: float, num_heads: int,
                       num_kv_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`add_norm_qkv_reference`'s contract in one launch, for one token."""
    if h.shape[0] != 1 or delta.shape[0] != 1 or delta.shape[-1] != h.shape[1]:
        raise ValueError(f"fused_add_norm_qkv serves one token's row, got h {tuple(h.shape)}, delta "
                         f"{tuple(delta.shape)}")
    h_out = torch.empty_like(h)
    q = fused_qkv_norm_rope_cache(h, weight, q_norm, k_norm, cos, sin, k_cache, v_cache, slots, eps, num_heads,
                                  num_kv_heads, (h.contiguous(), delta.contiguous(), norm, h_out))
    return h_out, q


@fused_add_norm_qkv.register_fake
def _(h, delta, norm, weight, q_norm, k_norm, cos, sin, k_cache, v_cache, slots, eps, num_heads, num_kv_heads):
    return torch.empty_like(h), h.new_empty(h.shape[0], num_heads, q_norm.shape[0])


def add_norm_qkv(h: torch.Tensor, delta: torch.Tensor, norm: torch.Tensor, weight: torch.Tensor,
                 q_norm: torch.Tensor, k_norm: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, eps: float, num_heads: int,
                 num_kv_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `add_norm_qkv_reference`: one launch for one token, else
    `layer_ops.add_rms_norm` then `qkv_norm_rope_cache` above (chosen here, not inside an op: an eager
    prefill step pays no second dispatch)."""
    if h.shape[0] == 1:
        return fused_add_norm_qkv(h, delta, norm, weight, q_norm, k_norm, cos, sin, k_cache, v_cache, slots, eps,
                                  num_heads, num_kv_heads)
    h, x = add_rms_norm(h, delta, norm, eps)
    return h, qkv_norm_rope_cache(x, weight, q_norm, k_norm, cos, sin, k_cache, v_cache, slots, eps, num_heads,
                                  num_kv_heads)
