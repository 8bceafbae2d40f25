"""The attention's q/k/v projection + q/k norm + RoPE + cache write in one launch (for one token
with the residual add and input norm before it), against its reference (CPU: Triton's
interpreter, float32; GPU: bf16 at Qwen3-30B-A3B's shape, and in a CUDA graph)."""
from __future__ import annotations

import pytest
import torch

from zipmoe.engine.rope import MRope
from zipmoe.kernels import dependent_launch
from zipmoe.kernels.embed_rope import mrope_cos_sin_reference
from zipmoe.kernels.qkv_norm_rope import (QKV_BLOCK_T, QKV_MAX_T, add_norm_qkv, add_norm_qkv_reference,
                                         fused_add_norm_qkv, fused_qkv_norm_rope_cache, qkv_norm_rope_cache,
                                         qkv_norm_rope_cache_reference)

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
SECTIONS = {16: (4, 2, 2), 128: (24, 20, 20)}  # mRoPE sections: tiny, Qwen3-30B


def _case(device, T, hidden, hq, hkv, d, seed=0):
    g = torch.Generator().manual_seed(seed)
    dt = torch.float32 if device == "cpu" else torch.bfloat16
    x = torch.randn(T, hidden, generator=g).to(device, dt)
    w = (torch.randn((hq + 2 * hkv) * d, hidden, generator=g) / hidden ** 0.5).to(device, dt)
    qn, kn = (torch.rand(d, generator=g).to(device, dt) + 0.5 for _ in range(2))
    positions = torch.stack([torch.arange(T) * 3, torch.arange(T) + 7, torch.arange(T) * 2]).to(device)
    rope = MRope(d, 1e6, SECTIONS[d], torch.device(device))
    cos, sin = mrope_cos_sin_reference(positions, rope.inv_freq, rope.axis, dt)
    slots = torch.randperm(64, generator=g)[:T].to(device)
    return x, w, qn, kn, cos, sin, slots, dt


def _check(device, T, hidden, hq, hkv, d, impl=fused_qkv_norm_rope_cache, runs=2):
    x, w, qn, kn, cos, sin, slots, dt = _case(device, T, hidden, hq, hkv, d)
    caches = [torch.zeros(64, hkv, d, dtype=dt, device=device) for _ in range(4)]
    want = qkv_norm_rope_cache_reference(x, w, qn, kn, cos, sin, caches[2], caches[3], slots, 1e-6, hq, hkv)
    # bf16: the projection sums in another order than cuBLAS, which can move a rounding by one ulp.
    tol = {} if dt == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    for _ in range(runs):  # twice: the arrival counters must be back at zero
        got = impl(x, w, qn, kn, cos, sin, caches[0], caches[1], slots, 1e-6, hq, hkv)
        torch.testing.assert_close(got, want, **tol)
        torch.testing.assert_close(caches[0], caches[2], **tol)
        torch.testing.assert_close(caches[1], caches[3], **tol)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("T,hidden,hq,hkv,d", [(1, 96, 4, 2, 16), (5, 1100, 4, 2, 16), (QKV_BLOCK_T, 64, 2, 1, 16)])
def test_fused_qkv_norm_rope_cache_matches_reference(device, T, hidden, hq, hkv, d):
    """One token, an input width split 8 ways unevenly (splits left empty), a full token tile."""
    _check(device, T, hidden, hq, hkv, d)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("load_ahead", [0.0, 1.0])
def test_qkv_weights_loaded_ahead_of_the_wait_in_any_share(device, load_ahead, monkeypatch):
    """None of a split's weights loaded ahead of the wait, or all of them in its first step (the
    committed share, half, is every other test's)."""
    monkeypatch.setattr(dependent_launch, "load_ahead", load_ahead)
    _check(device, 5, 1100, 4, 2, 16)
    test_add_norm_qkv_matches_reference(device, 1, 1100, 4, 2, 16, 8, fused_add_norm_qkv)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("T", [QKV_MAX_T, QKV_MAX_T + 2])
def test_qkv_norm_rope_cache_matches_reference_on_both_sides_of_its_threshold(device, T):
    _check(device, T, 96, 4, 2, 16, impl=qkv_norm_rope_cache)


def test_fused_qkv_norm_rope_cache_refuses_more_than_a_token_tile():
    x, w, qn, kn, cos, sin, slots, _ = _case("cpu", QKV_BLOCK_T + 1, 32, 2, 1, 16)
    k_cache, v_cache = (torch.zeros(64, 1, 16) for _ in range(2))
    with pytest.raises(ValueError, match=f"at most {QKV_BLOCK_T} tokens"):
        fused_qkv_norm_rope_cache(x, w, qn, kn, cos, sin, k_cache, v_cache, slots, 1e-6, 2, 1)


def test_qkv_norm_rope_cache_rounds_where_the_two_launches_round():
    """float16 with small whole numbers, so the projection is exact in any order: q and both caches
    are bit-identical to the GEMM then `qk_norm_rope_cache` (float32 elsewhere on CPU would hide a
    rounding put in the wrong place). 8 splits, 3 of them empty."""
    from zipmoe.kernels.layer_ops import qk_norm_rope_cache

    x, w, qn, kn, cos, sin, slots, _ = _case("cpu", 5, 1100, 4, 2, 16)
    x, w = x.round().clamp(-3, 3).half(), (w * 30).round().clamp(-2, 2).half()
    qn, kn, cos, sin = qn.half(), kn.half(), cos.half(), sin.half()
    caches = [torch.zeros(64, 2, 16, dtype=torch.float16) for _ in range(4)]
    got = fused_qkv_norm_rope_cache(x, w, qn, kn, cos, sin, caches[0], caches[1], slots, 1e-6, 4, 2)
    want = qk_norm_rope_cache(torch.nn.functional.linear(x, w), qn, kn, cos, sin, caches[2], caches[3], slots,
                              1e-6, 4, 2)
    assert torch.equal(got, want) and torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])


def _add_norm_case(device, T, hidden, slots_per_token):
    """h [T, hidden], delta [T, hidden] or [T, K, hidden] (a MoE layer's slot outputs), norm weight."""
    g = torch.Generator().manual_seed(hidden + slots_per_token)
    dt = torch.float32 if device == "cpu" else torch.bfloat16
    h = torch.randn(T, hidden, generator=g).to(device, dt)
    shape = (T, hidden) if slots_per_token == 0 else (T, slots_per_token, hidden)
    delta = (torch.randn(*shape, generator=g) * 0.3).to(device, dt)
    return h, delta, (torch.rand(hidden, generator=g) + 0.5).to(device, dt)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("T,hidden,hq,hkv,d,slots_per_token", [(1, 96, 4, 2, 16, 0), (1, 1100, 4, 2, 16, 8),
                                                               (1, 64, 2, 1, 16, 3), (QKV_MAX_T + 2, 96, 4, 2, 16, 4)])
@pytest.mark.parametrize("impl", [fused_add_norm_qkv, add_norm_qkv], ids=["fused", "op"])
def test_add_norm_qkv_matches_reference(device, T, hidden, hq, hkv, d, slots_per_token, impl):
    """The residual add (the slot sum on the way) and the input norm made inside the q/k/v launch
    for one token, the input width split unevenly; the op past one token: the norm, then q/k/v."""
    if impl is fused_add_norm_qkv and T > 1:
        pytest.skip("the one launch serves one token")
    _, w, qn, kn, cos, sin, slots, dt = _case(device, T, hidden, hq, hkv, d)
    h, delta, norm = _add_norm_case(device, T, hidden, slots_per_token)
    caches = [torch.zeros(64, hkv, d, dtype=dt, device=device) for _ in range(4)]
    want = add_norm_qkv_reference(h, delta, norm, w, qn, kn, cos, sin, caches[2], caches[3], slots, 1e-6, hq, hkv)
    tol = {} if dt == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    for _ in range(2):  # twice: the arrival counters must be back at zero
        got = impl(h, delta, norm, w, qn, kn, cos, sin, caches[0], caches[1], slots, 1e-6, hq, hkv)
        torch.testing.assert_close(got[0], want[0], **({} if slots_per_token < 2 else tol))
        torch.testing.assert_close(got[1], want[1], **tol)
        torch.testing.assert_close(caches[0], caches[2], **tol)
        torch.testing.assert_close(caches[1], caches[3], **tol)


def test_fused_add_norm_qkv_op_schema_and_fake():
    """The one launch is the op; `add_norm_qkv` chooses it or the two launches outside any op."""
    _, w, qn, kn, cos, sin, slots, _ = _case("cpu", 1, 32, 2, 1, 16)
    h, delta, norm = _add_norm_case("cpu", 1, 32, 4)
    k_cache, v_cache = (torch.zeros(64, 1, 16) for _ in range(2))
    torch.library.opcheck(torch.ops.zipmoe.fused_add_norm_qkv.default,
                          (h, delta, norm, w, qn, kn, cos, sin, k_cache, v_cache, slots, 1e-6, 2, 1),
                          test_utils=("test_schema", "test_faketensor"))


@pytest.mark.gpu
@pytest.mark.parametrize("slots_per_token", [0, 8])
def test_add_norm_qkv_30b_shape(slots_per_token):
    _, w, qn, kn, cos, sin, slots, dt = _case("cuda", 1, 2048, 32, 4, 128)
    h, delta, norm = _add_norm_case("cuda", 1, 2048, slots_per_token)
    caches = [torch.zeros(64, 4, 128, dtype=dt, device="cuda") for _ in range(4)]
    got = fused_add_norm_qkv(h, delta, norm, w, qn, kn, cos, sin, caches[0], caches[1], slots, 1e-6, 32, 4)
    want = add_norm_qkv_reference(h, delta, norm, w, qn, kn, cos, sin, caches[2], caches[3], slots, 1e-6, 32, 4)
    for a, b in zip(got + (caches[0], caches[1]), want + (caches[2], caches[3])):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("T", [QKV_MAX_T, QKV_MAX_T + 2])
def test_qkv_norm_rope_cache_op_schema_and_fake(T):
    x, w, qn, kn, cos, sin, slots, dt = _case("cpu", T, 32, 2, 1, 16)
    k_cache, v_cache = (torch.zeros(64, 1, 16) for _ in range(2))
    torch.library.opcheck(torch.ops.zipmoe.qkv_norm_rope_cache.default,
                          (x, w, qn, kn, cos, sin, k_cache, v_cache, slots, 1e-6, 2, 1),
                          test_utils=("test_schema", "test_faketensor"))


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 16])
def test_qkv_norm_rope_cache_30b_shape(T):
    _check("cuda", T, 2048, 32, 4, 128)


@pytest.mark.gpu
def test_qkv_norm_rope_cache_replays_in_a_cuda_graph():
    x, w, qn, kn, cos, sin, slots, dt = _case("cuda", 4, 2048, 32, 4, 128)
    caches = [torch.zeros(64, 4, 128, dtype=dt, device="cuda") for _ in range(4)]
    fused_qkv_norm_rope_cache(x, w, qn, kn, cos, sin, caches[0], caches[1], slots, 1e-6, 32, 4)  # compile outside
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = fused_qkv_norm_rope_cache(x, w, qn, kn, cos, sin, caches[0], caches[1], slots, 1e-6, 32, 4)
    x.copy_(torch.randn_like(x))
    graph.replay()
    want = qkv_norm_rope_cache_reference(x, w, qn, kn, cos, sin, caches[2], caches[3], slots, 1e-6, 32, 4)
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(caches[0], caches[2], rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(caches[1], caches[3], rtol=2e-2, atol=2e-2)
