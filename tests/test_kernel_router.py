"""The router in one launch (its GEMM, softmax, top-K), and for one token with the residual add
and RMSNorm before it, against the references (CPU: Triton's interpreter, float32; GPU: bf16)."""
from __future__ import annotations

import pytest
import torch

from zipmoe.kernels.layer_ops import router_reference
from zipmoe.kernels.router import (ROUTER_MAX_T, add_norm_router, add_norm_router_reference,
                                   fused_add_norm_router, fused_router, router)

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _dtype(device):
    return torch.float32 if device == "cpu" else torch.bfloat16


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("T,H,E,K,normalize", [(1, 2048, 128, 8, True), (3, 1100, 16, 4, True), (5, 96, 60, 2, False),
                                               (33, 64, 16, 4, True), (ROUTER_MAX_T + 1, 64, 16, 4, True)])
@pytest.mark.parametrize("impl", [fused_router, router], ids=["fused_router", "router"])
def test_router_matches_reference(device, T, H, E, K, normalize, impl):
    """The router's GEMM and top-K in one launch (several token tiles and expert blocks, E not a
    multiple of the block, batch 1 with H split 8 ways, H split unevenly with splits left empty),
    and `router`, which past ROUTER_MAX_T takes two launches. Twice in a row: the programs' arrival
    counters must be left at zero for the next launch."""
    g = torch.Generator().manual_seed(T)
    x = torch.randn(T, H, generator=g).to(device, _dtype(device))
    gate = (torch.randn(E, H, generator=g) / H ** 0.5).to(device, _dtype(device))
    probs_ref, ids_ref, w_ref = router_reference(x, gate, K, normalize)
    # bf16: the GEMM sums in another order than cuBLAS, which can move a logit by one ulp and swap
    # two experts whose probabilities were that close; float32 (CPU) gives the same ids.
    for _ in range(2):
        probs, ids, w = impl(x, gate, K, normalize)
        torch.testing.assert_close(probs, probs_ref, **({} if device == "cpu" else dict(rtol=2e-2, atol=1e-3)))
        if device == "cpu":
            assert torch.equal(ids, ids_ref)
            torch.testing.assert_close(w, w_ref)
        else:
            assert (ids == ids_ref).float().mean() > 0.95


@pytest.mark.parametrize("T", [ROUTER_MAX_T, ROUTER_MAX_T + 1])
def test_router_op_schema_and_fake(T):
    """On both sides of ROUTER_MAX_T (the one launch, then the GEMM and `topk_softmax`)."""
    x, gate = torch.randn(T, 64), torch.randn(16, 64)
    torch.library.opcheck(torch.ops.zipmoe.router.default, (x, gate, 4, True),
                          test_utils=("test_schema", "test_faketensor"))


def test_fused_router_refuses_more_tokens_than_its_counters():
    x, gate = torch.randn(257, 8), torch.randn(4, 8)
    with pytest.raises(ValueError, match="at most 256 tokens"):
        fused_router(x, gate, 2, True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("T,H,E,K", [(1, 2048, 128, 8), (1, 1100, 60, 4), (1, 96, 16, 2),
                                     (3, 96, 16, 2)])
@pytest.mark.parametrize("impl", [fused_add_norm_router, add_norm_router], ids=["fused", "op"])
def test_add_norm_router_matches_reference(device, T, H, E, K, impl):
    """The residual add and norm made inside the router's launch for one token (H split over
    programs, unevenly at 1100), and the op, which past one token takes the norm then the router.
    The residual and the normed input are the experts' inputs: they match the separate norm's."""
    if impl is fused_add_norm_router and T > 1:
        pytest.skip("the one launch serves one token")
    g = torch.Generator().manual_seed(H)
    dt = _dtype(device)
    h, delta = (torch.randn(T, H, generator=g).to(device, dt) for _ in range(2))
    norm = (torch.rand(H, generator=g) + 0.5).to(device, dt)
    gate = (torch.randn(E, H, generator=g) / H ** 0.5).to(device, dt)
    want = add_norm_router_reference(h, delta, norm, gate, K, True, 1e-6)
    for _ in range(2):  # twice: the arrival counters must be back at zero
        got = impl(h, delta, norm, gate, K, True, 1e-6)
        torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)  # the residual add rounds the same way
        tol = {} if device == "cpu" else dict(rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(got[1], want[1], **tol)
        torch.testing.assert_close(got[2], want[2], **({} if device == "cpu" else dict(rtol=2e-2, atol=1e-3)))
        if device == "cpu":
            assert torch.equal(got[3], want[3])
            torch.testing.assert_close(got[4], want[4])
        else:
            assert (got[3] == want[3]).float().mean() > 0.95


def test_fused_add_norm_router_op_schema_and_fake():
    """The one launch is the op; `add_norm_router` chooses it or the two launches outside any op."""
    h, delta, norm, gate = torch.randn(1, 64), torch.randn(1, 64), torch.rand(64) + 0.5, torch.randn(16, 64)
    torch.library.opcheck(torch.ops.zipmoe.fused_add_norm_router.default, (h, delta, norm, gate, 4, True, 1e-6),
                          test_utils=("test_schema", "test_faketensor"))


def test_fused_add_norm_router_refuses_more_than_one_token():
    h = torch.randn(2, 64)
    with pytest.raises(ValueError, match="one token"):
        fused_add_norm_router(h, h, torch.ones(64), torch.randn(16, 64), 4, True, 1e-6)
