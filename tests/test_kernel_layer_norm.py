"""The vision tower's fused residual add + LayerNorm against its reference (CPU: Triton interpreter,
float32, as the interpreter rounds float32 -> bf16 by truncation; GPU: bf16 as served), and the
reference against the transformers block's own ops."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from zipmoe.kernels.layer_norm import add_layer_norm, add_layer_norm_reference, layer_norm, layer_norm_reference


def _case(T, N, dtype, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    x, delta = (torch.randn(T, N, generator=g) * 3 + 0.5).to(device, dtype), torch.randn(T, N, generator=g).to(device, dtype)
    weight, bias = (torch.rand(N, generator=g) + 0.5).to(device, dtype), (torch.randn(N, generator=g) * 0.1).to(device, dtype)
    return x, delta, weight, bias


# float32 statistics in another order than torch's Welford: the last float32 bits, and rarely one
# bf16 rounding, may move
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=1.6e-2, atol=1.6e-2)}


@pytest.mark.parametrize("T,N", [(1, 8), (37, 1152), (5, 100), (16, 4608)])
def test_add_layer_norm_matches_reference(T, N):
    dtype = torch.float32
    x, delta, w, b = _case(T, N, dtype)
    (s, y), (s_ref, y_ref) = add_layer_norm(x, delta, w, b, 1e-6), add_layer_norm_reference(x, delta, w, b, 1e-6)
    assert torch.equal(s, s_ref)  # the add rounds once to the stream's dtype, as the reference's does
    assert y.dtype == dtype and y.shape == (T, N)
    torch.testing.assert_close(y, y_ref, **TOL[dtype])
    torch.testing.assert_close(layer_norm(x, w, b, 1e-6), layer_norm_reference(x, w, b, 1e-6), **TOL[dtype])


def test_empty_and_strided_inputs():
    x, delta, w, b = _case(6, 64, torch.float32)
    empty = x[:0]
    assert layer_norm(empty, w, b, 1e-6).shape == (0, 64)
    wide = torch.randn(6, 128)
    strided, w_strided = wide[:, ::2], torch.rand(128)[::2]  # not contiguous: copied first
    torch.testing.assert_close(layer_norm(strided, w_strided, b, 1e-6), layer_norm_reference(strided, w_strided, b, 1e-6),
                               **TOL[torch.float32])
    with pytest.raises(ValueError, match="one dtype"):
        add_layer_norm(x, delta.double(), w, b, 1e-6)


def test_reference_is_the_blocks_arithmetic():
    """transformers' vision block: `hidden_states = hidden_states + attn(...)`, then `norm2(hidden_states)`."""
    x, delta, w, b = _case(37, 1152, torch.bfloat16)
    norm = torch.nn.LayerNorm(1152, eps=1e-6, dtype=torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(w)
        norm.bias.copy_(b)
    s, y = add_layer_norm_reference(x, delta, w, b, 1e-6)
    assert torch.equal(s, x + delta) and torch.equal(y, norm(x + delta))
    assert torch.equal(layer_norm_reference(x, w, b, 1e-6), F.layer_norm(x, (1152,), w, b, 1e-6))


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 1024, 30 * 1024])
def test_add_layer_norm_matches_reference_gpu(T):
    x, delta, w, b = _case(T, 1152, torch.bfloat16, "cuda")
    (s, y), (s_ref, y_ref) = add_layer_norm(x, delta, w, b, 1e-6), add_layer_norm_reference(x, delta, w, b, 1e-6)
    assert torch.equal(s, s_ref)
    torch.testing.assert_close(y, y_ref, **TOL[torch.bfloat16])
    torch.testing.assert_close(layer_norm(x, w, b, 1e-6), layer_norm_reference(x, w, b, 1e-6), **TOL[torch.bfloat16])
