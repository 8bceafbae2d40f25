"""The small per-token steps of a decoder layer fused into single launches (Triton), beside their
PyTorch references.

At decode batch sizes a layer's norms, q/k norms, rotary embedding, cache writes and router
top-K are each a chain of tiny element-wise kernels: about sixty launches a layer, which in a
CUDA graph still cost a few microseconds each and, over 48 layers, more than reading the
weights. Each function here is one launch:

- `rms_norm`: RMSNorm of each row;
- `add_rms_norm`: residual add + RMSNorm (the residual stream and the normed input in one pass),
  summing a MoE layer's K slot outputs on the way (`fused_moe.fused_experts_per_slot`);
- `qk_norm_rope_cache`: per-head RMSNorm of q and k, rotary embedding, and the K/V cache write;
- `topk_softmax`: router softmax -> top-K -> renormalisation (the router's GEMM with it in one
  launch: `router.py`).

Each `name` is the launch the engine calls on CUDA; `name_reference` beside it is the plain
PyTorch version with the same signature, which the engine runs elsewhere (`apply_rope` is a piece
of `qk_norm_rope_cache_reference`). The arithmetic follows the references step by step (float32
statistics, rounding to the model dtype where PyTorch rounds), so bf16 results agree with them to
the last bit except where a float32 sum is taken in another order.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .dependent_launch import launch_options, wait_for_inputs

import triton  # after zipmoe.kernels (the package) chose the interpreter on CPU-only machines
import triton.language as tl


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Same arithmetic as transformers: normalise in float32, scale in the input dtype.
    dtype = x.dtype
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def add_rms_norm_reference(h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(h + delta, rms_norm(h + delta)): the residual stream and the next block's input. delta
    [T, N], or [T, K, N] whose K rows per token are summed first (a MoE layer's slot outputs)."""
    h = h + sum_slots(delta).to(h.dtype)
    return h, rms_norm_reference(h, weight, eps)


def sum_slots(delta: torch.Tensor) -> torch.Tensor:
    """[T, K, N] -> [T, N] summed over K (float32 inside, rounded to delta's dtype); [T, N] as is."""
    return delta.sum(dim=1) if delta.dim() == 3 else delta


@triton.jit
def residual_sum(h_ptr, delta_ptr, cols, mask, N, SLOTS: tl.constexpr):
    """h + delta at `cols` of one token's row of N: delta's SLOTS rows summed in float32 and rounded
    once, as `sum_slots` rounds, then added in h's dtype, as `add_rms_norm_reference` adds. Also used
    by the kernels that take a layer's input norm in (`router.py`, `qkv_norm_rope.py`)."""
    h = tl.load(h_ptr + cols, mask=mask, other=0.0)
    delta = tl.load(delta_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    for j in tl.static_range(1, SLOTS):
        delta += tl.load(delta_ptr + j * N + cols, mask=mask, other=0.0).to(tl.float32)
    return (h.to(tl.float32) + delta.to(h.dtype).to(tl.float32)).to(h.dtype)


@triton.jit
def inverse_rms(row, N, eps):
    """1 / RMS of a whole row (float32 statistics, padding lanes zero)."""
    r32 = row.to(tl.float32)
    return inverse_rms_of_squares(tl.sum(r32 * r32, axis=0), N, eps)


@triton.jit
def inverse_rms_of_squares(squares, N, eps):
    """1 / RMS of a row of N from its float32 sum of squares (also summed from parts, `qkv_norm_rope.py`)."""
    return tl.rsqrt(squares / N + eps)


@triton.jit
def weighted(row, w):
    """w * row rounded to row's dtype: RMSNorm's output before its 1 / RMS, for the kernels that
    apply that scale to their GEMV's sums instead (`folded_router.py`, `qkv_norm_rope.py`)."""
    return (w.to(tl.float32) * row.to(tl.float32)).to(row.dtype)


@triton.jit
def scaled(row, inv, w):
    """RMSNorm's output from the row, its `inverse_rms` and the weight, rounded as the reference rounds."""
    return (w.to(tl.float32) * (row.to(tl.float32) * inv).to(row.dtype).to(tl.float32)).to(row.dtype)


@triton.jit
def _add_rms_norm_kernel(h_ptr, delta_ptr, w_ptr, h_out_ptr, x_out_ptr, N, eps,
                         HAS_DELTA: tl.constexpr, SLOTS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    wait_for_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < N
    if HAS_DELTA:
        h = residual_sum(h_ptr + row * N, delta_ptr + row * SLOTS * N, cols, ok, N, SLOTS)
        tl.store(h_out_ptr + row * N + cols, h, mask=ok)
    else:
        h = tl.load(h_ptr + row * N + cols, mask=ok, other=0.0)
    x = scaled(h, inverse_rms(h, N, eps), tl.load(w_ptr + cols, mask=ok, other=0.0))
    tl.store(x_out_ptr + row * N + cols, x, mask=ok)


def _launch_norm(h, delta, weight, eps, h_out, x_out):
    T, N = h.shape
    if T:
        _add_rms_norm_kernel[(T,)](h, delta if delta is not None else h, weight, h_out, x_out, N, eps,
                                   HAS_DELTA=delta is not None,
                                   SLOTS=delta.shape[1] if delta is not None and delta.dim() == 3 else 1,
                                   BLOCK=triton.next_power_of_2(N), num_warps=4 if N <= 4096 else 8,
                                   **launch_options(h.device))


@torch.library.custom_op("zipmoe::rms_norm", mutates_args=())
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Same contract as `rms_norm_reference` for x [T, N] contiguous; one launch."""
    out = torch.empty_like(x)
    _launch_norm(x, None, weight, eps, out, out)
    return out


@rms_norm.register_fake
def _(x, weight, eps):
    return torch.empty_like(x)


@torch.library.custom_op("zipmoe::add_rms_norm", mutates_args=())
def add_rms_norm(h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `add_rms_norm_reference` for h [T, N] and delta [T, N] or [T, K, N],
    contiguous; one launch, the slot sum included."""
    h_out, x_out = torch.empty_like(h), torch.empty_like(h)
    _launch_norm(h, delta.contiguous(), weight, eps, h_out, x_out)
    return h_out, x_out


@add_rms_norm.register_fake
def _(h, delta, weight, eps):
    return torch.empty_like(h), torch.empty_like(h)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, head_dim]; cos/sin [T, head_dim]; rotate-half convention."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def qk_norm_rope_cache_reference(qkv: torch.Tensor, q_norm: torch.Tensor, k_norm: torch.Tensor, cos: torch.Tensor,
                                 sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                 slots: torch.Tensor, eps: float, num_heads: int, num_kv_heads: int) -> torch.Tensor:
    """qkv [T, (Hq + 2 Hkv) * D] from the fused projection -> q [T, Hq, D] normed and rotated; k
    (normed, rotated) and v are written to the caches [slots, Hkv, D] at `slots` [T]."""
    T, D = qkv.shape[0], q_norm.shape[0]
    q, k, v = qkv.split([num_heads * D, num_kv_heads * D, num_kv_heads * D], dim=-1)
    q = apply_rope(rms_norm_reference(q.reshape(T, num_heads, D), q_norm, eps), cos, sin)
    k = apply_rope(rms_norm_reference(k.reshape(T, num_kv_heads, D), k_norm, eps), cos, sin)
    k_cache[slots] = k
    v_cache[slots] = v.reshape(T, num_kv_heads, D)
    return q


@triton.jit
def _qk_norm_rope_cache_kernel(qkv_ptr, qn_ptr, kn_ptr, cos_ptr, sin_ptr, kc_ptr, vc_ptr, slots_ptr, q_out_ptr,
                               eps, HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, PDL: tl.constexpr):
    wait_for_inputs(PDL)
    t = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)  # q heads, then k heads, then v heads
    d = tl.arange(0, D)
    HALF: tl.constexpr = D // 2
    row = qkv_ptr + t * (HQ + 2 * HKV) * D + head * D
    slot = tl.load(slots_ptr + t).to(tl.int64)
    if head >= HQ + HKV:  # v: copied into the cache as is
        tl.store(vc_ptr + (slot * HKV + head - HQ - HKV) * D + d, tl.load(row + d))
        return
    x = tl.load(row + d)
    partner = tl.load(row + (d + HALF) % D)  # rotate-half: x[d + D/2] for the first half, x[d - D/2] after
    if head < HQ:
        w = tl.load(qn_ptr + d)
        w_partner = tl.load(qn_ptr + (d + HALF) % D)
    else:
        w = tl.load(kn_ptr + d)
        w_partner = tl.load(kn_ptr + (d + HALF) % D)
    x32 = x.to(tl.float32)
    inv = tl.rsqrt(tl.sum(x32 * x32, axis=0) / D + eps)
    # Round where PyTorch rounds: normalise (f32) -> dtype, * weight -> dtype.
    xn = (w.to(tl.float32) * (x32 * inv).to(x.dtype).to(tl.float32)).to(x.dtype)
    pn = (w_partner.to(tl.float32) * (partner.to(tl.float32) * inv).to(x.dtype).to(tl.float32)).to(x.dtype)
    rotated = tl.where(d < HALF, -pn.to(tl.float32), pn.to(tl.float32))
    cos = tl.load(cos_ptr + t * D + d).to(tl.float32)
    sin = tl.load(sin_ptr + t * D + d).to(tl.float32)
    out = ((xn.to(tl.float32) * cos).to(x.dtype).to(tl.float32) + (rotated * sin).to(x.dtype).to(tl.float32)).to(x.dtype)
    if head < HQ:
        tl.store(q_out_ptr + (t * HQ + head) * D + d, out)
    else:
        tl.store(kc_ptr + (slot * HKV + head - HQ) * D + d, out)


@torch.library.custom_op("zipmoe::qk_norm_rope_cache", mutates_args=("k_cache", "v_cache"))
def qk_norm_rope_cache(qkv: torch.Tensor, q_norm: torch.Tensor, k_norm: torch.Tensor, cos: torch.Tensor,
                       sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                       eps: float, num_heads: int, num_kv_heads: int) -> torch.Tensor:
    """Same contract as `qk_norm_rope_cache_reference`; one launch over (token, head)."""
    T, D = qkv.shape[0], q_norm.shape[0]
    if D & (D - 1):
        raise ValueError(f"head_dim {D} must be a power of two")
    q = torch.empty(T, num_heads, D, dtype=qkv.dtype, device=qkv.device)
    if T:
        _qk_norm_rope_cache_kernel[(T, num_heads + 2 * num_kv_heads)](
            qkv.contiguous(), q_norm, k_norm, cos.contiguous(), sin.contiguous(), k_cache, v_cache, slots, q, eps,
            HQ=num_heads, HKV=num_kv_heads, D=D, num_warps=1 if D <= 128 else 2, **launch_options(qkv.device))
    return q


@qk_norm_rope_cache.register_fake
def _(qkv, q_norm, k_norm, cos, sin, k_cache, v_cache, slots, eps, num_heads, num_kv_heads):
    return qkv.new_empty(qkv.shape[0], num_heads, q_norm.shape[0])


def topk_softmax_reference(logits: torch.Tensor, top_k: int, normalize: bool,
                           dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (probs float32 [T, E], top-K ids by score, weights in `dtype`,
    renormalised to sum 1 when asked)."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return probs, ids, weights.to(dtype)


@triton.jit
def store_softmax_topk(logit, rows, T, E, probs_ptr, ids_ptr, w_ptr, R: tl.constexpr, K: tl.constexpr,
                       E_PAD: tl.constexpr, K_PAD: tl.constexpr, NORMALIZE: tl.constexpr):
    """Router logits [R, E_PAD] (float32) of token rows `rows` [R] -> their softmax, top-K ids and
    weights, stored; columns past E and rows past T are masked out. Shared with the one-launch
    router (`router.py`)."""
    e = tl.arange(0, E_PAD)
    ok = (rows[:, None] < T) & (e[None, :] < E)
    logit = tl.where(e[None, :] < E, logit, float("-inf"))  # rows past T stay finite (masked out below)
    p = tl.exp(logit - tl.max(logit, axis=1)[:, None])
    p = p / tl.sum(p, axis=1)[:, None]
    tl.store(probs_ptr + rows[:, None] * E + e[None, :], p, mask=ok)
    slot = tl.arange(0, K_PAD)
    ids = tl.zeros([R, K_PAD], dtype=tl.int64)
    ws = tl.zeros([R, K_PAD], dtype=tl.float32)
    left = tl.where(ok, p, -1.0)
    for k in tl.static_range(K):  # K is small (8): K passes of max + argmax beat a sort
        best = tl.argmax(left, axis=1, tie_break_left=True)
        ws = tl.where(slot[None, :] == k, tl.max(left, axis=1)[:, None], ws)
        ids = tl.where(slot[None, :] == k, best[:, None].to(tl.int64), ids)
        left = tl.where(e[None, :] == best[:, None], -1.0, left)
    if NORMALIZE:
        ws = ws / tl.sum(ws, axis=1)[:, None]
    keep = (rows[:, None] < T) & (slot[None, :] < K)
    tl.store(ids_ptr + rows[:, None] * K + slot[None, :], ids, mask=keep)
    tl.store(w_ptr + rows[:, None] * K + slot[None, :], ws.to(w_ptr.dtype.element_ty), mask=keep)


@triton.jit
def _topk_softmax_kernel(logits_ptr, probs_ptr, ids_ptr, w_ptr, T, E, K: tl.constexpr, E_PAD: tl.constexpr,
                         K_PAD: tl.constexpr, NORMALIZE: tl.constexpr, PDL: tl.constexpr):
    wait_for_inputs(PDL)
    rows = tl.program_id(0).to(tl.int64) + tl.arange(0, 1)  # one token a program
    e = tl.arange(0, E_PAD)
    logit = tl.load(logits_ptr + rows[:, None] * E + e[None, :], mask=e[None, :] < E, other=0.0).to(tl.float32)
    store_softmax_topk(logit, rows, T, E, probs_ptr, ids_ptr, w_ptr, 1, K, E_PAD, K_PAD, NORMALIZE)


@torch.library.custom_op("zipmoe::topk_softmax", mutates_args=())
def topk_softmax(logits: torch.Tensor, top_k: int, normalize: bool,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Same contract as `topk_softmax_reference` (ties: the lowest expert id first); one launch."""
    T, E = logits.shape
    probs = torch.empty(T, E, dtype=torch.float32, device=logits.device)
    ids = torch.empty(T, top_k, dtype=torch.int64, device=logits.device)
    weights = torch.empty(T, top_k, dtype=dtype, device=logits.device)
    if T:
        _topk_softmax_kernel[(T,)](logits.contiguous(), probs, ids, weights, T, E, K=top_k,
                                   E_PAD=triton.next_power_of_2(E), K_PAD=triton.next_power_of_2(top_k),
                                   NORMALIZE=normalize, num_warps=1 if E <= 256 else 4, **launch_options(logits.device))
    return probs, ids, weights


@topk_softmax.register_fake
def _(logits, top_k, normalize, dtype):
    T, E = logits.shape
    return (logits.new_empty(T, E, dtype=torch.float32), logits.new_empty(T, top_k, dtype=torch.int64),
            logits.new_empty(T, top_k, dtype=dtype))


def router_reference(x: torch.Tensor, gate: torch.Tensor, top_k: int,
                     normalize: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The router: logits x @ gate.T in x's dtype, softmax in float32 -> (probs [T, E], top-K ids
    sorted by score, weights in x's dtype, renormalised to sum 1 when asked)."""
    return topk_softmax_reference(F.linear(x, gate), top_k, normalize, x.dtype)
