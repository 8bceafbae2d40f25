"""The start of a forward in one launch (Triton): the tokens' embeddings, the first layer's input
norm and the mRoPE cos/sin every layer's rotary embedding reads, beside their PyTorch references.

Why. In PyTorch these are an embedding gather, an RMSNorm and a chain of eight element-wise
kernels for the cos/sin (the positions to float32, times the frequencies, the gather of each
frequency's axis, a concatenation, cos, sin, two roundings). In a batch-1 decode step's CUDA graph
each launch costs 2-4 us, PDL-less as PyTorch's kernels are, while the layers' own launches hide
theirs: about 30 us of a 2.9 ms step on an H100 (`profile_decode`, session 43) for a few kilobytes
of work. Here a program per token does all of it.

The arithmetic is the references' (`mrope_cos_sin_reference` is what `engine/rope.py`'s MRope
computes): the position rounded to float32 and multiplied by its frequency in float32, cos and
sin in float32 (Triton's `tl.cos` and `tl.sin` are libdevice's cosf and sinf, as PyTorch's), then
rounded to the model's dtype; the norm as `layer_ops.rms_norm`.

Called by `engine/model.py` (`Qwen3VLMoeTextDecoder.first_qkv`): `embed_norm_rope` where the
step's embeddings are the table's rows (decode, text prompts), `norm_rope` where they were
gathered before (image rows replaced by visual features; the prefill graphs' first piece).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .dependent_launch import launch_options, wait_for_inputs
from .layer_ops import inverse_rms, rms_norm_reference, scaled

import triton  # after zipmoe.kernels (the package) chose the interpreter on CPU-only machines
import triton.language as tl


def mrope_cos_sin_reference(positions: torch.Tensor, inv_freq: torch.Tensor, axis: torch.Tensor,
                            dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [3, T] (t, h, w), inv_freq [D/2] float32, axis [D/2] (which position drives
    frequency i) -> cos, sin [T, D] in `dtype`, each frequency twice (rotate-half)."""
    freqs = positions.to(torch.float32)[:, :, None] * inv_freq[None, None, :]  # [3, T, D/2]
    freqs = freqs.gather(0, axis.view(1, 1, -1).expand(1, freqs.shape[1], -1))[0]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def norm_rope_reference(h: torch.Tensor, weight: torch.Tensor, eps: float, positions: torch.Tensor,
                        inv_freq: torch.Tensor, axis: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """h [T, N] -> (rms_norm(h), cos, sin), cos and sin in h's dtype."""
    return (rms_norm_reference(h, weight, eps), *mrope_cos_sin_reference(positions, inv_freq, axis, h.dtype))


def embed_norm_rope_reference(ids: torch.Tensor, embed: torch.Tensor, weight: torch.Tensor, eps: float,
                              positions: torch.Tensor, inv_freq: torch.Tensor,
                              axis: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids [T] -> (h = the embedding table's rows [T, N], rms_norm(h), cos, sin)."""
    h = F.embedding(ids, embed)
    return (h, *norm_rope_reference(h, weight, eps, positions, inv_freq, axis))


@triton.jit
def _embed_norm_rope_kernel(ids_ptr, src_ptr, w_ptr, pos_ptr, pos_stride, inv_freq_ptr, axis_ptr, h_out_ptr,
                            x_out_ptr, cos_ptr, sin_ptr, N, eps, GATHER: tl.constexpr, BLOCK: tl.constexpr,
                            D: tl.constexpr, PDL: tl.constexpr):
    # Program t: token t's row (GATHER: the table's row ids[t], stored to h_out), its norm, and its
    # cos/sin, frequency i of the D / 2 driven by position axis[i] of the token's (t, h, w).
    wait_for_inputs(PDL)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < N
    if GATHER:
        row = tl.load(ids_ptr + t).to(tl.int64)
        h = tl.load(src_ptr + row * N + cols, mask=ok, other=0.0)
        tl.store(h_out_ptr + t * N + cols, h, mask=ok)
    else:
        h = tl.load(src_ptr + t * N + cols, mask=ok, other=0.0)
    tl.store(x_out_ptr + t * N + cols, scaled(h, inverse_rms(h, N, eps), tl.load(w_ptr + cols, mask=ok, other=0.0)),
             mask=ok)
    d = tl.arange(0, D)
    freq = d % (D // 2)
    position = tl.load(pos_ptr + tl.load(axis_ptr + freq) * pos_stride + t).to(tl.float32)
    angle = position * tl.load(inv_freq_ptr + freq)
    tl.store(cos_ptr + t * D + d, tl.cos(angle).to(cos_ptr.dtype.element_ty))
    tl.store(sin_ptr + t * D + d, tl.sin(angle).to(sin_ptr.dtype.element_ty))


def _launch(ids, src, h_out, weight, eps, positions, inv_freq, axis):
    """(x, cos, sin) of the T rows (ids given: the table src's rows ids, stored to h_out)."""
    T, N, D = positions.shape[1], src.shape[1], 2 * inv_freq.shape[0]
    if D & (D - 1):
        raise ValueError(f"head_dim {D} must be a power of two")
    if positions.stride(1) != 1:
        positions = positions.contiguous()
    x = torch.empty(T, N, dtype=src.dtype, device=src.device)
    cos, sin = (torch.empty(T, D, dtype=src.dtype, device=src.device) for _ in range(2))
    if T:
        _embed_norm_rope_kernel[(T,)](
            src if ids is None else ids, src, weight, positions, positions.stride(0), inv_freq, axis,
            x if h_out is None else h_out, x, cos, sin, N, eps, GATHER=ids is not None,
            BLOCK=triton.next_power_of_2(N), D=D, num_warps=4 if N <= 4096 else 8, **launch_options(src.device))
    return x, cos, sin


@torch.library.custom_op("zipmoe::norm_rope", mutates_args=())
def norm_rope(h: torch.Tensor, weight: torch.Tensor, eps: float, positions: torch.Tensor, inv_freq: torch.Tensor,
              axis: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Same contract as `norm_rope_reference` for h [T, N] contiguous; one launch."""
    return _launch(None, h, None, weight, eps, positions, inv_freq, axis)


@norm_rope.register_fake
def _(h, weight, eps, positions, inv_freq, axis):
    D = 2 * inv_freq.shape[0]
    return torch.empty_like(h), h.new_empty(h.shape[0], D), h.new_empty(h.shape[0], D)


@torch.library.custom_op("zipmoe::embed_norm_rope", mutates_args=())
def embed_norm_rope(ids: torch.Tensor, embed: torch.Tensor, weight: torch.Tensor, eps: float, positions: torch.Tensor,
                    inv_freq: torch.Tensor,
                    axis: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Same contract as `embed_norm_rope_reference` for ids [T] of the table embed [vocab, N] (the
    caller keeps them in range: `engine.add_request` checks a prompt's); one launch."""
    h = torch.empty(ids.shape[0], embed.shape[1], dtype=embed.dtype, device=embed.device)
    return (h, *_launch(ids.contiguous(), embed, h, weight, eps, positions, inv_freq, axis))


@embed_norm_rope.register_fake
def _(ids, embed, weight, eps, positions, inv_freq, axis):
    T, N, D = ids.shape[0], embed.shape[1], 2 * inv_freq.shape[0]
    return embed.new_empty(T, N), embed.new_empty(T, N), embed.new_empty(T, D), embed.new_empty(T, D)
