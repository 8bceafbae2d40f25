"""Fused per-token layer steps (norms, q/k norm + RoPE + cache write, top-K) against their
references, and the whole tiny decoder run through every kernel against the reference path
(CPU: Triton interpreter, float32; GPU: bf16)."""
from __future__ import annotations

import pytest
import torch

from zipmoe.engine.engine import EngineConfig, LLMEngine
from zipmoe.engine.model import KERNELS, REFERENCE
from zipmoe.engine.rope import MRope
from zipmoe.engine.sequence import SamplingParams
from zipmoe.kernels.embed_rope import mrope_cos_sin_reference
from zipmoe.kernels.layer_ops import (add_rms_norm, add_rms_norm_reference, qk_norm_rope_cache,
                                      qk_norm_rope_cache_reference, rms_norm, rms_norm_reference, topk_softmax,
                                      topk_softmax_reference)

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _dtype(device):
    return torch.float32 if device == "cpu" else torch.bfloat16


def _norm_case(device, N):
    """h, delta [5, N], weight [N], and the tolerance of the normed output (one bf16 ulp near 1)."""
    g = torch.Generator().manual_seed(N)
    dt = _dtype(device)
    h, delta = (torch.randn(5, N, generator=g).to(device, dt) for _ in range(2))
    w = torch.rand(N, generator=g).to(device, dt) + 0.5
    return h, delta, w, {} if dt == torch.float32 else dict(rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("N", [64, 48, 2048])
def test_rms_norm_matches_reference(device, N):
    h, _, w, tol = _norm_case(device, N)
    torch.testing.assert_close(rms_norm(h, w, 1e-6), rms_norm_reference(h, w, 1e-6), **tol)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("N", [64, 48, 2048])
def test_add_rms_norm_matches_reference(device, N):
    h, delta, w, tol = _norm_case(device, N)
    got, want = add_rms_norm(h, delta, w, 1e-6), add_rms_norm_reference(h, delta, w, 1e-6)
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)  # the residual add rounds the same way
    torch.testing.assert_close(got[1], want[1], **tol)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("K", [1, 3, 8])
def test_add_rms_norm_sums_a_moe_layers_slot_outputs(device, K):
    """delta [T, K, N] (fused_experts_per_slot's output): summed, then added and normed, as the
    reference sums the slots and adds; the residual rounds alike up to the float32 sum's order."""
    h, delta, w, tol = _norm_case(device, 2048)
    slots = torch.stack([delta * (0.5 + j) for j in range(K)], dim=1)
    got, want = add_rms_norm(h, slots, w, 1e-6), add_rms_norm_reference(h, slots, w, 1e-6)
    torch.testing.assert_close(got[0], want[0], **tol)
    torch.testing.assert_close(got[1], want[1], **tol)
    if K == 1:
        assert torch.equal(add_rms_norm(h, slots[:, 0], w, 1e-6)[0], got[0])


@pytest.mark.gpu
def test_the_slot_sum_rounds_as_the_separate_sum_did_gpu():
    """bf16 on CUDA (the interpreter rounds float32 -> bf16 differently): summing the slots inside
    add_rms_norm gives the residual of the old path, add_rms_norm(h, slots.sum(1)), except where the
    float32 sum over the slots is taken in another order (a rare last-bit difference)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(64, 2048, generator=g, device="cuda").bfloat16()
    slots = (torch.randn(64, 8, 2048, generator=g, device="cuda") * 0.3).bfloat16()
    w = torch.rand(2048, generator=g, device="cuda").bfloat16() + 0.5
    fused, separate = add_rms_norm(h, slots, w, 1e-6), add_rms_norm(h, slots.sum(dim=1), w, 1e-6)
    differ = (fused[0] != separate[0]).float().mean().item()
    assert differ < 0.01, f"{differ:.2%} of the residual differs"
    torch.testing.assert_close(fused[0], separate[0], rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("hq,hkv,d", [(4, 2, 16), (32, 4, 128)])
def test_qk_norm_rope_cache_matches_reference(device, hq, hkv, d):
    g = torch.Generator().manual_seed(d)
    dt, T = _dtype(device), 6
    qkv = torch.randn(T, (hq + 2 * hkv) * d, generator=g).to(device, dt)
    qn, kn = (torch.rand(d, generator=g).to(device, dt) + 0.5 for _ in range(2))
    rope = MRope(d, 1e6, {16: (4, 2, 2), 128: (24, 20, 20)}[d], torch.device(device))  # tiny, Qwen3-30B
    positions = torch.stack([torch.arange(T) * 3, torch.arange(T) + 7, torch.arange(T) * 2]).to(device)
    cos, sin = mrope_cos_sin_reference(positions, rope.inv_freq, rope.axis, dt)
    slots = torch.tensor([9, 2, 31, 0, 17, 5], device=device)
    caches = [torch.zeros(32, hkv, d, dtype=dt, device=device) for _ in range(4)]
    q = qk_norm_rope_cache(qkv, qn, kn, cos, sin, caches[0], caches[1], slots, 1e-6, hq, hkv)
    q_ref = qk_norm_rope_cache_reference(qkv, qn, kn, cos, sin, caches[2], caches[3], slots, 1e-6, hq, hkv)
    # bf16: a float32 sum in another order can move a rounding by one ulp (~0.8 % of values near 1),
    # which rotation turns into an absolute error where two such values cancel.
    tol = {} if dt == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(q, q_ref, **tol)
    torch.testing.assert_close(caches[0], caches[2], **tol)
    torch.testing.assert_close(caches[1], caches[3], rtol=0, atol=0)  # v is copied as is


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("E,K,normalize", [(16, 4, True), (128, 8, True), (60, 2, False)])
def test_topk_softmax_matches_reference(device, E, K, normalize):
    # float32 logits on both devices: bf16 logits tie often, and torch.topk orders ties as it likes.
    logits = torch.randn(33, E, generator=torch.Generator().manual_seed(E)).to(device)
    probs, ids, w = topk_softmax(logits, K, normalize, _dtype(device))
    probs_ref, ids_ref, w_ref = topk_softmax_reference(logits, K, normalize, _dtype(device))
    torch.testing.assert_close(probs, probs_ref)
    assert torch.equal(ids, ids_ref)
    torch.testing.assert_close(w, w_ref)


def _generate(checkpoint, device, ops, prompts, steps=6):
    eng = LLMEngine(checkpoint, EngineConfig(device=device, num_kv_blocks=64, max_model_len=256, cuda_graphs=False))
    eng.model.ops = ops
    seqs = [eng.add_request(p, SamplingParams(max_tokens=steps, ignore_eos=True)) for p in prompts]
    while eng.has_work:
        eng.step()
    return [s.output_ids for s in seqs]


@pytest.mark.parametrize("prompts", [[list(range(10, 30)), list(range(40, 47)), list(range(100, 133))],
                                     [list(range(10, 30))]], ids=["batch3", "batch1"])
def test_decoder_through_every_kernel_matches_the_reference_path(tiny_checkpoint, prompts):
    """Fused norms, q/k/v with its norms, RoPE and cache writes, the output projection, the router
    with the norm before it, experts and paged decode attention, in Triton's interpreter, give the
    reference path's greedy tokens (float32); a lone sequence's decode steps take every one-token
    kernel (the norms inside the router's and the q/k/v's launches, no align)."""
    assert _generate(tiny_checkpoint, "cpu", KERNELS, prompts) == _generate(tiny_checkpoint, "cpu", REFERENCE, prompts)
