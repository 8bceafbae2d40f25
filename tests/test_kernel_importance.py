"""Triton patch importance (kernels/attention_importance.py) against the materialised reference,
and the reference against a brute-force softmax.

CPU: float32 in Triton's interpreter, small images with small tiles so that images span several
tiles, end mid-tile, or hold a single patch. GPU: bf16 at the Qwen3-VL-30B shape, plus its memory.
"""
from __future__ import annotations

import math

import pytest
import torch

from zipmoe.kernels.attention_importance import (patch_importance, patch_importance_reference,
                                                 patch_importance_with_tiles)

# The interpreter's own scalar handling of loop bounds trips this numpy deprecation on every program.

LENGTHS = [1, 17, 40, 33, 16, 5]  # with 16-wide tiles: one patch, mid-tile ends, an exact tile


def _inputs(lengths, heads, d, dtype=torch.float32, device="cpu", seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    n = sum(lengths)
    q = torch.randn(n, heads, d, generator=g, device=device).to(dtype)
    k = torch.randn(n, heads, d, generator=g, device=device).to(dtype)
    cu = torch.tensor([0, *lengths], device=device).cumsum(0).to(torch.int32)
    return q, k, cu, d ** -0.5


def _per_image_sums(x, lengths):
    return torch.stack([s.sum() for s in x.split(lengths)])


@pytest.mark.parametrize("d", [16, 72])
def test_patch_importance_matches_reference_over_many_tiles(d):
    q, k, cu, scale = _inputs(LENGTHS, heads=3, d=d)
    got = patch_importance_with_tiles(q, k, cu, scale, block_m=16, block_n=16)
    want = patch_importance_reference(q, k, cu, scale)
    assert got.dtype == torch.float32 and got.shape == (sum(LENGTHS),)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    # Each image's values sum to its patch count; a lone patch attends only to itself.
    torch.testing.assert_close(_per_image_sums(got, LENGTHS), torch.tensor(LENGTHS, dtype=torch.float32))
    assert got[0].item() == pytest.approx(1.0)


def test_patch_importance_default_tiles_and_strided_inputs():
    """The production tiling (128), and q/k as the vision hook produces them: views into one
    packed qkv tensor, so neither is contiguous."""
    lengths, heads, d = [130, 3, 64], 2, 72
    qkv = torch.randn(sum(lengths), 3, heads, d, generator=torch.Generator().manual_seed(1))
    q, k, _ = qkv.permute(1, 0, 2, 3).unbind(0)
    assert not q.is_contiguous()
    cu = torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)
    got = patch_importance(q, k, cu, d ** -0.5)
    torch.testing.assert_close(got, patch_importance_reference(q, k, cu, d ** -0.5), rtol=1e-5, atol=1e-6)


def test_patch_importance_deterministic_and_registered_as_op():
    q, k, cu, scale = _inputs([1, 20, 7], heads=2, d=16, seed=2)
    first = patch_importance_with_tiles(q, k, cu, scale)
    assert torch.equal(first, patch_importance_with_tiles(q, k, cu, scale))
    assert torch.equal(first, torch.ops.zipmoe.patch_importance(q, k, cu, scale))
    # Schema and fake (meta) kernel; the autograd/AOT checks would only re-run the interpreter.
    torch.library.opcheck(torch.ops.zipmoe.patch_importance.default, (q, k, cu, scale),
                          test_utils=("test_schema", "test_faketensor"))


def test_patch_importance_rejects_bad_boundaries():
    q, k, _, scale = _inputs([4, 4], heads=1, d=16)
    with pytest.raises(ValueError):
        patch_importance(q, k, torch.tensor([0, 4, 7], dtype=torch.int32), scale)
    with pytest.raises(ValueError):
        patch_importance(q, k[:, :, :8], torch.tensor([0, 4, 8], dtype=torch.int32), scale)


def _brute_importance(q, k, scale):
    n, heads, _ = q.shape
    total = torch.zeros(n, dtype=torch.float64)
    for h in range(heads):
        for i in range(n):
            logits = [float(q[i, h] @ k[j, h]) * scale for j in range(n)]
            z = sum(math.exp(x) for x in logits)
            total += torch.tensor([math.exp(x) / z for x in logits], dtype=torch.float64)
    return total / (heads * n) * n


def test_patch_importance_reference_matches_brute_force_and_stays_inside_images():
    g = torch.Generator().manual_seed(0)
    sizes, heads, d = [5, 12, 7], 3, 8
    q, k = torch.randn(sum(sizes), heads, d, generator=g), torch.randn(sum(sizes), heads, d, generator=g)
    cu = torch.tensor([0, 5, 17, 24], dtype=torch.int32)
    scale = d ** -0.5
    imp = patch_importance_reference(q, k, cu, scale)
    assert imp.dtype == torch.float32 and imp.shape == (24,)
    for start, end in zip(cu[:-1].tolist(), cu[1:].tolist()):
        want = _brute_importance(q[start:end], k[start:end], scale)
        assert torch.allclose(imp[start:end].double(), want, atol=1e-5)
        assert imp[start:end].sum().item() == pytest.approx(end - start, abs=1e-4)

    # Changing the middle image changes nothing outside it.
    k2 = k.clone()
    k2[5:17] = torch.randn(12, heads, d, generator=g) * 5
    imp2 = patch_importance_reference(q, k2, cu, scale)
    assert torch.equal(imp2[:5], imp[:5]) and torch.equal(imp2[17:], imp[17:])
    assert not torch.allclose(imp2[5:17], imp[5:17])


@pytest.mark.gpu
@pytest.mark.parametrize("lengths", [[1024] * 30, [1, 17, 1000, 4096, 64, 333]], ids=["30x1024", "mixed"])
def test_patch_importance_matches_reference_bf16_on_cuda(lengths):
    heads, d = 16, 72  # Qwen3-VL-30B's vision tower: 1152 wide, 16 heads
    q, k, cu, scale = _inputs(lengths, heads, d, dtype=torch.bfloat16, device="cuda")
    got = patch_importance(q, k, cu, scale)
    want = patch_importance_reference(q, k, cu, scale)  # float32 from the same bf16 values
    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-4)
    torch.testing.assert_close(_per_image_sums(got, lengths).cpu(), torch.tensor(lengths, dtype=torch.float32),
                               rtol=1e-3, atol=1e-3)


@pytest.mark.gpu
def test_patch_importance_cuda_memory_is_linear_in_patches():
    lengths, heads, d = [1024] * 30, 16, 72
    q, k, cu, scale = _inputs(lengths, heads, d, dtype=torch.bfloat16, device="cuda")
    patch_importance(q, k, cu, scale)  # compile outside the measurement
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = patch_importance(q, k, cu, scale)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    n, p = max(lengths), sum(lengths)
    assert peak < heads * n * n * 4 / 8  # one image's float32 attention matrices: 64 MiB here
    assert peak <= 3 * heads * p * 4 + (1 << 20)  # lse + column sums [heads, P], the output, tile tables
    assert out.shape == (p,)
