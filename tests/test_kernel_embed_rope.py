"""The forward's first launch (embeddings, first input norm, mRoPE cos/sin) against its reference
(CPU: Triton's interpreter, float32; GPU: bf16 at Qwen3-30B-A3B's shape)."""
from __future__ import annotations

import pytest
import torch

from zipmoe.engine.rope import MRope
from zipmoe.kernels.embed_rope import embed_norm_rope, embed_norm_rope_reference, norm_rope, norm_rope_reference

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
SHAPES = {"cpu": (48, 16, (4, 2, 2)), "cuda": (2048, 128, (24, 20, 20))}  # hidden, head_dim, mRoPE sections


def _case(device, T, vocab=97):
    """ids [T], the table, the norm's weight, positions [3, T] (a slice of a wider buffer, as the
    decode graphs pass theirs: distinct t, h, w, up to 200,000), the MRope."""
    hidden, d, sections = SHAPES[device]
    g = torch.Generator().manual_seed(T)
    dt = torch.float32 if device == "cpu" else torch.bfloat16
    embed = torch.randn(vocab, hidden, generator=g).to(device, dt)
    w = (torch.rand(hidden, generator=g) + 0.5).to(device, dt)
    ids = torch.randint(0, vocab, (T,), generator=g).to(device)
    wide = torch.randint(0, 200_000, (3, T + 5), generator=g)
    wide[:, 0] = 0
    positions = wide.to(device)[:, :T]
    return ids, embed, w, positions, MRope(d, 5e6, sections, torch.device(device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("T", [1, 7])
def test_embed_norm_rope_matches_reference(device, T):
    ids, embed, w, positions, rope = _case(device, T)
    got = embed_norm_rope(ids, embed, w, 1e-6, positions, rope.inv_freq, rope.axis)
    want = embed_norm_rope_reference(ids, embed, w, 1e-6, positions, rope.inv_freq, rope.axis)
    assert torch.equal(got[0], want[0])  # the table's rows, copied
    # The norm: one bf16 ulp where a float32 sum of squares is taken in another order.
    torch.testing.assert_close(got[1], want[1], **({} if device == "cpu" else dict(rtol=2e-2, atol=2e-2)))
    if device == "cuda":  # libdevice's cosf and sinf, as PyTorch's: the same bits
        assert torch.equal(got[2], want[2]) and torch.equal(got[3], want[3])
    else:
        torch.testing.assert_close(got[2:], want[2:])


@pytest.mark.parametrize("device", DEVICES)
def test_norm_rope_takes_rows_gathered_before(device):
    """Image rows replaced by visual features: the launch norms the rows it is given."""
    ids, embed, w, positions, rope = _case(device, 5)
    h = embed[ids] * 3
    got = norm_rope(h, w, 1e-6, positions, rope.inv_freq, rope.axis)
    want = norm_rope_reference(h, w, 1e-6, positions, rope.inv_freq, rope.axis)
    torch.testing.assert_close(got[0], want[0], **({} if device == "cpu" else dict(rtol=2e-2, atol=2e-2)))
    torch.testing.assert_close(got[1:], want[1:], **({} if device == "cpu" else dict(rtol=0, atol=0)))


def test_a_step_of_no_tokens_and_a_head_dim_not_a_power_of_two():
    ids, embed, w, positions, rope = _case("cpu", 3)
    h, x, cos, sin = embed_norm_rope(ids[:0], embed, w, 1e-6, positions[:, :0], rope.inv_freq, rope.axis)
    assert h.shape == x.shape == (0, 48) and cos.shape == sin.shape == (0, 16)
    with pytest.raises(ValueError, match="power of two"):
        embed_norm_rope(ids, embed, w, 1e-6, positions, rope.inv_freq[:6], rope.axis[:6])
