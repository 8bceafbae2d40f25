"""One decode token's q/k/v left unfinished by its launch and finished by the paged attention
(`qkv_norm_rope.add_norm_qkv_partials`, then `paged_attention.paged_decode_attention_from_qkv`), against
`add_norm_qkv_reference` then `paged_decode_attention_reference`: h + delta, the attention's output
and both caches (the token's key and value written at its slot). CPU: Triton's interpreter, float32;
GPU: bf16 at Qwen3-30B-A3B's shape, and in a CUDA graph."""
from __future__ import annotations

import pytest
import torch

from zipmoe.kernels import paged_attention
from zipmoe.kernels.paged_attention import paged_decode_attention_from_qkv, paged_decode_attention_reference
from zipmoe.kernels.qkv_norm_rope import add_norm_qkv_partials, add_norm_qkv_reference

from test_kernel_paged_attention import make_case
from test_kernel_qkv_norm_rope import _add_norm_case, _case

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
EPS = 1e-6


def _chain(device, ctx, hidden=96, hq=4, hkv=2, d=16, slots_per_token=8):
    """(inputs of the two launches, what the references give: h + delta, the attention, both caches)."""
    _, w, qn, kn, cos, sin, _, dt = _case(device, 1, hidden, hq, hkv, d)
    h, delta, norm = _add_norm_case(device, 1, hidden, slots_per_token)
    _, k_cache, v_cache, tables, lens = make_case([ctx], hkv, hq // hkv, d, dtype=dt, device=device)
    newest = ctx - 1
    slots = (tables[0, newest // 16].long() * 16 + newest % 16).reshape(1)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    want_h, q = add_norm_qkv_reference(h, delta, norm, w, qn, kn, cos, sin, want_k, want_v, slots, EPS, hq, hkv)
    want = paged_decode_attention_reference(q, want_k, want_v, tables, lens, 16, d ** -0.5)
    args = (h, delta, norm, w, qn, kn, cos, sin, k_cache, v_cache, slots, tables, lens, hq, hkv, d, hidden)
    return args, (want_h, want, want_k, want_v)


def _run(h, delta, norm, w, qn, kn, cos, sin, k_cache, v_cache, slots, tables, lens, hq, hkv, d, hidden):
    h_out, partial, squares = add_norm_qkv_partials(h, delta, norm, w, hq, hkv)
    out = paged_decode_attention_from_qkv(partial, squares, qn, kn, cos, sin, k_cache, v_cache, slots, tables, lens,
                                          16, d ** -0.5, EPS, hq, hidden)
    return h_out, out, k_cache, v_cache


def _assert_close(got, want, device):
    # bf16: the projection and the attention sum in other orders than the references.
    tol = dict(rtol=1e-4, atol=1e-5) if device == "cpu" else dict(rtol=2e-2, atol=2e-2)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **tol)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("ctx", [1, 40, 200])
@pytest.mark.parametrize("max_splits,ahead", [(16, True), (16, False), (1, True)])
def test_attention_finishes_the_qkv_launchs_heads(device, ctx, max_splits, ahead, monkeypatch):
    """Contexts of one key (the token's own), of one split and of several merged splits; the keys
    ahead of the wait or not; one split of several key tiles (the newest in a later tile, read in
    the loop). Twice: the arrival counters are back at zero."""
    monkeypatch.setattr(paged_attention, "MAX_SPLITS", max_splits)
    monkeypatch.setattr(paged_attention, "keys_ahead", ahead)
    args, want = _chain(device, ctx)
    for _ in range(2):
        _assert_close(_run(*args), want, device)


def test_attention_from_qkv_refuses_more_than_one_token():
    args, _ = _chain("cpu", 8)
    h, delta, norm, w, qn, kn, cos, sin, k_cache, v_cache, slots, tables, lens, hq, hkv, d, hidden = args
    _, partial, squares = add_norm_qkv_partials(h, delta, norm, w, hq, hkv)
    with pytest.raises(ValueError, match="one token's q/k/v partials"):
        paged_decode_attention_from_qkv(partial, squares, qn, kn, cos, sin, k_cache, v_cache, slots.repeat(2),
                                        tables, lens, 16, d ** -0.5, EPS, hq, hidden)


def test_the_two_ops_schemas_and_fakes():
    args, _ = _chain("cpu", 8)
    h, delta, norm, w, qn, kn, cos, sin, k_cache, v_cache, slots, tables, lens, hq, hkv, d, hidden = args
    torch.library.opcheck(torch.ops.zipmoe.add_norm_qkv_partials.default, (h, delta, norm, w, hq, hkv),
                          test_utils=("test_schema", "test_faketensor"))
    _, partial, squares = add_norm_qkv_partials(h, delta, norm, w, hq, hkv)
    torch.library.opcheck(torch.ops.zipmoe.paged_decode_attention_from_qkv.default,
                          (partial, squares, qn, kn, cos, sin, k_cache, v_cache, slots, tables, lens, 16, d ** -0.5,
                           EPS, hq, hidden), test_utils=("test_schema", "test_faketensor"))


@pytest.mark.gpu
@pytest.mark.parametrize("ctx", [256, 4096])
def test_attention_finishes_qkv_at_the_30b_shape_in_a_cuda_graph(ctx):
    args, want = _chain("cuda", ctx, hidden=2048, hq=32, hkv=4, d=128)
    _assert_close(_run(*args), want, "cuda")  # eagerly first: the arrival counters are made then
    args, want = _chain("cuda", ctx, hidden=2048, hq=32, hkv=4, d=128)  # fresh caches
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = _run(*args)
    graph.replay()
    _assert_close(got, want, "cuda")
