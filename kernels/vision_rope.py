"""The vision tower's rotary embedding of q and k in one launch (Triton), beside its PyTorch reference.

transformers' `apply_rotary_pos_emb_vision` casts q and k to float32, builds rotate_half with two
slices, a negation and a concatenation, multiplies and adds, and casts back: about sixteen
element-wise kernels a layer, each reading or writing a float32 copy of q or k. For 30 images of
1,024 patches (16 heads of 72) that is ~2 GB of memory traffic a layer where the rotation needs to
read q and k once and write them once. Here one launch per layer does it, in float32 arithmetic in
the reference's order, rounding once to the input dtype.
"""
from __future__ import annotations

import torch

import triton  # after zipmoe.kernels (the package) chose the interpreter on CPU-only machines
import triton.language as tl


def vision_rope_reference(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                          sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k [P, heads, d] (any strides); cos, sin [P, d] -> rotated (q, k) in q's and k's dtypes.
    The arithmetic of transformers' apply_rotary_pos_emb_vision: x * cos + rotate_half(x) * sin in
    float32, rotate_half(x) = cat(-x[d/2:], x[:d/2])."""
    def rotate(x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        half = x32.shape[-1] // 2
        rotated = torch.cat((-x32[..., half:], x32[..., :half]), dim=-1)
        return ((x32 * c) + (rotated * s)).to(x.dtype)

    c, s = cos.unsqueeze(-2).float(), sin.unsqueeze(-2).float()
    return rotate(q), rotate(k)


@triton.jit
def _rotate_rows(x_ptr, out_ptr, rows, row_ok, cols, col_ok, c1, c2, s1, s2, stride_p, stride_h, HEADS,
                 HALF: tl.constexpr):
    for h in range(HEADS):
        src = x_ptr + rows[:, None].to(tl.int64) * stride_p + h * stride_h + cols[None, :]
        dst = out_ptr + (rows[:, None].to(tl.int64) * HEADS + h) * (2 * HALF) + cols[None, :]
        mask = row_ok[:, None] & col_ok[None, :]
        x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
        # out[:half] = x1 * cos1 + (-x2) * sin1;  out[half:] = x2 * cos2 + x1 * sin2
        tl.store(dst, (x1 * c1 + -x2 * s1).to(out_ptr.dtype.element_ty), mask=mask)
        tl.store(dst + HALF, (x2 * c2 + x1 * s2).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _vision_rope_kernel(q_ptr, k_ptr, cos_ptr, sin_ptr, q_out_ptr, k_out_ptr, P, HEADS,
                        q_stride_p, q_stride_h, k_stride_p, k_stride_h,
                        HALF: tl.constexpr, HALF_PAD: tl.constexpr, BLOCK_P: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
    cols = tl.arange(0, HALF_PAD)
    row_ok, col_ok = rows < P, cols < HALF
    mask = row_ok[:, None] & col_ok[None, :]
    trig = rows[:, None].to(tl.int64) * (2 * HALF) + cols[None, :]
    c1 = tl.load(cos_ptr + trig, mask=mask, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + trig + HALF, mask=mask, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + trig, mask=mask, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + trig + HALF, mask=mask, other=0.0).to(tl.float32)
    _rotate_rows(q_ptr, q_out_ptr, rows, row_ok, cols, col_ok, c1, c2, s1, s2, q_stride_p, q_stride_h, HEADS, HALF)
    _rotate_rows(k_ptr, k_out_ptr, rows, row_ok, cols, col_ok, c1, c2, s1, s2, k_stride_p, k_stride_h, HEADS, HALF)


@torch.library.custom_op("zipmoe::vision_rope", mutates_args=())
def vision_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `vision_rope_reference`; one launch. q and k may be strided views (the
    unbound qkv projection) as long as their last dimension is contiguous; the outputs are contiguous."""
    P, heads, d = q.shape
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k.stride(-1) != 1:
        k = k.contiguous()
    cos, sin = cos.contiguous(), sin.contiguous()
    q_out, k_out = torch.empty(P, heads, d, dtype=q.dtype, device=q.device), torch.empty(
        P, heads, d, dtype=k.dtype, device=k.device)
    block_p = 16
    _vision_rope_kernel[(triton.cdiv(P, block_p),)](
        q, k, cos, sin, q_out, k_out, P, heads, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        HALF=d // 2, HALF_PAD=triton.next_power_of_2(d // 2), BLOCK_P=block_p, num_warps=4)
    return q_out, k_out


@vision_rope.register_fake
def _(q, k, cos, sin):
    return torch.empty_like(q, memory_format=torch.contiguous_format), torch.empty_like(
        k, memory_format=torch.contiguous_format)
