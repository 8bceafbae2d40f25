"""The vision tower's LayerNorms with the residual add before them, one launch each (Triton), beside
their PyTorch references.

Each of the tower's 27 blocks adds the attention's output to the residual stream, normalises it for
the MLP, adds the MLP's output and normalises again for the next block: four element-wise passes
over a [patches, 1152] stream (for 30 images of 1,024 patches, 4 x 27 launches and about 16 ms of
an H200's 72 ms of kernels, docs/PERFORMANCE.md). `add_layer_norm` does an add and the LayerNorm
after it in one pass and hands back both the new stream and its normalised copy; the tower's
forward (`vision.VisionEncoder`) uses it for both adds of a block, the second fused with the next
block's first norm.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

import triton  # after zipmoe.kernels (the package) chose the interpreter on CPU-only machines
import triton.language as tl


def layer_norm_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, N] -> LayerNorm over N (torch's own: float32 statistics, rounded once to x's dtype)."""
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def add_layer_norm_reference(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                             eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, layer_norm(x + delta)): the residual stream, its sum rounded to x's dtype as
    transformers' `hidden_states + ...` rounds it, and the next sub-layer's input."""
    x = x + delta
    return x, layer_norm_reference(x, weight, bias, eps)


@triton.jit
def _add_layer_norm_kernel(x_ptr, delta_ptr, w_ptr, b_ptr, sum_ptr, out_ptr, N, eps,
                           HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < N
    x = tl.load(x_ptr + row * N + cols, mask=ok, other=0.0)
    if HAS_DELTA:
        x = (x.to(tl.float32) + tl.load(delta_ptr + row * N + cols, mask=ok, other=0.0).to(tl.float32)).to(x.dtype)
        tl.store(sum_ptr + row * N + cols, x, mask=ok)
    x32 = x.to(tl.float32)
    mean = tl.sum(x32, axis=0) / N
    centred = tl.where(ok, x32 - mean, 0.0)
    rstd = tl.rsqrt(tl.sum(centred * centred, axis=0) / N + eps)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * N + cols, (centred * rstd * w + b).to(x.dtype), mask=ok)


def _launch(x, delta, weight, bias, eps, sum_out, out):
    T, N = x.shape
    if delta is not None and delta.dtype != x.dtype:  # the kernel rounds the sum to x's dtype
        raise ValueError(f"add_layer_norm: x is {x.dtype}, delta {delta.dtype}; give both one dtype")
    weight, bias = weight.contiguous(), bias.contiguous()
    if T:
        _add_layer_norm_kernel[(T,)](x, delta if delta is not None else x, weight, bias,
                                     sum_out if sum_out is not None else out, out, N, eps,
                                     HAS_DELTA=delta is not None, BLOCK=triton.next_power_of_2(N),
                                     num_warps=4 if N <= 4096 else 8)


@torch.library.custom_op("zipmoe::layer_norm", mutates_args=())
def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """Same contract as `layer_norm_reference` for x [T, N]; one launch."""
    x = x.contiguous()
    out = torch.empty_like(x)
    _launch(x, None, weight, bias, eps, None, out)
    return out


@layer_norm.register_fake
def _(x, weight, bias, eps):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("zipmoe::add_layer_norm", mutates_args=())
def add_layer_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                   eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `add_layer_norm_reference` for x and delta [T, N] of one dtype; one launch."""
    x, delta = x.contiguous(), delta.contiguous()
    sum_out, out = torch.empty_like(x), torch.empty_like(x)
    _launch(x, delta, weight, bias, eps, sum_out, out)
    return sum_out, out


@add_layer_norm.register_fake
def _(x, delta, weight, bias, eps):
    return torch.empty_like(x, memory_format=torch.contiguous_format), torch.empty_like(
        x, memory_format=torch.contiguous_format)
