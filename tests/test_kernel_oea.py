"""OEA re-route kernel against its reference (CPU: Triton interpreter; GPU: CUDA): the same ids,
weights to float32 rounding before the cast to the weights' dtype."""
from __future__ import annotations

import itertools

import pytest
import torch

from zipmoe.kernels.oea_reroute import oea_reroute, oea_reroute_reference


def _case(T, K, E, seed, dtype=torch.float32, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    probs = torch.softmax(torch.randn(T, E, generator=g) * 2, dim=1)
    top_p, ids = probs.topk(K, dim=1)
    weights = (top_p / top_p.sum(dim=1, keepdim=True)).to(dtype)
    opt_out = torch.rand(T, generator=g) < 0.2
    return [t.to(device) for t in (probs, ids, weights, opt_out)]


def _check(got, want, dtype):
    assert torch.equal(got[0], want[0])
    assert got[1].dtype == want[1].dtype
    tol = dict(rtol=0, atol=0) if dtype == torch.bfloat16 else dict(rtol=1e-6, atol=1e-7)
    if dtype == torch.bfloat16:  # one float32 rounding apart before the cast: at most one bf16 step
        torch.testing.assert_close(got[1].float(), want[1].float(), rtol=8e-3, atol=1e-6)
    else:
        torch.testing.assert_close(got[1], want[1], **tol)


CASES = list(itertools.product([1, 5, 16, 33], [(4, 16), (8, 128)], [1, 2, 3], [True, False]))


@pytest.mark.parametrize("T,KE,k0,normalize", CASES)
def test_oea_reroute_matches_reference(T, KE, k0, normalize):
    K, E = KE
    for dtype in (torch.float32, torch.bfloat16):
        probs, ids, weights, opt_out = _case(T, K, E, seed=T * 7 + k0, dtype=dtype)
        for oo in (None, opt_out):
            _check(oea_reroute(probs, ids, weights, oo, k0, normalize),
                   oea_reroute_reference(probs, ids, weights, oo, k0, normalize), dtype)


def test_a_lone_token_has_no_candidates_its_fills_get_weight_zero():
    """Batch 1: the union is the token's own top-k0, so every other slot is empty: it points at the
    first expert with weight 0, and the kept two carry all the weight."""
    probs, ids, weights, _ = _case(1, 8, 128, seed=5)
    new_ids, new_w = oea_reroute(probs, ids, weights, None, 2, True)
    assert torch.equal(new_ids[0, 2:], ids[0, :1].expand(6))
    assert torch.all(new_w[0, 2:] == 0) and torch.allclose(new_w[0, :2].sum(), torch.tensor(1.0))


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 16, 64, 128, 300])
def test_oea_reroute_matches_reference_gpu(T):
    for seed, k0 in [(0, 1), (1, 2), (2, 4)]:
        probs, ids, weights, opt_out = _case(T, 8, 128, seed, torch.bfloat16, "cuda")
        _check(oea_reroute(probs, ids, weights, opt_out, k0, True),
               oea_reroute_reference(probs, ids, weights, opt_out, k0, True), torch.bfloat16)
