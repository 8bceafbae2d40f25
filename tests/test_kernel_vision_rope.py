"""Vision rotary kernel against its reference (CPU: Triton interpreter; GPU: CUDA), and the reference
against transformers' apply_rotary_pos_emb_vision."""
from __future__ import annotations

import pytest
import torch
from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import apply_rotary_pos_emb_vision

from zipmoe.kernels.vision_rope import vision_rope, vision_rope_reference


def _case(P, heads, d, dtype, device="cpu", seed=0):
    """q and k as the tower has them: strided views of one qkv projection; cos/sin of real angles."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(P, 3, heads, d, generator=g).to(device=device, dtype=dtype)
    q, k, _ = qkv.unbind(1)
    angles = torch.rand(P, d // 2, generator=g) * 40
    angles = torch.cat([angles, angles], dim=-1).to(device)
    return q, k, angles.cos(), angles.sin()


@pytest.mark.parametrize("P,heads,d", [(1, 1, 8), (37, 3, 72), (64, 16, 72), (50, 4, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_vision_rope_matches_reference(P, heads, d, dtype):
    q, k, cos, sin = _case(P, heads, d, dtype)
    got, want = vision_rope(q, k, cos, sin), vision_rope_reference(q, k, cos, sin)
    for g, w in zip(got, want):
        assert g.dtype == dtype and g.shape == (P, heads, d) and g.is_contiguous()
        # float32 arithmetic in the same order; a fused multiply-add may move the last float32 bit,
        # and with it, rarely, one bf16 rounding
        tol = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=8e-3, atol=8e-3)
        torch.testing.assert_close(g, w, **tol)


def test_reference_is_transformers_arithmetic():
    q, k, cos, sin = _case(37, 3, 72, torch.bfloat16)
    for g, w in zip(vision_rope_reference(q, k, cos, sin), apply_rotary_pos_emb_vision(q, k, cos, sin)):
        assert torch.equal(g, w)


@pytest.mark.gpu
@pytest.mark.parametrize("P", [1, 1024, 30 * 1024])
def test_vision_rope_matches_reference_gpu(P):
    q, k, cos, sin = _case(P, 16, 72, torch.bfloat16, "cuda")
    for g, w in zip(vision_rope(q, k, cos, sin), vision_rope_reference(q, k, cos, sin)):
        torch.testing.assert_close(g, w, rtol=8e-3, atol=8e-3)
