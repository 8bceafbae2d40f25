"""The attention's output projection + residual add + RMSNorm in one launch (a candidate the engine
does not take yet), against its reference (CPU: Triton's interpreter, float32; GPU: bf16 at
Qwen3-30B-A3B's shape, and in a CUDA graph)."""
from __future__ import annotations

import pytest
import torch

from zipmoe.kernels.out_proj_norm import (OUT_BLOCK_T, fused_out_proj_add_rms_norm,
                                          out_proj_add_rms_norm_reference)

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _case(device, T, N, K, seed=0):
    g = torch.Generator().manual_seed(seed)
    dt = torch.float32 if device == "cpu" else torch.bfloat16
    h = torch.randn(T, N, generator=g).to(device, dt)
    attn = torch.randn(T, K, generator=g).to(device, dt)
    w = (torch.randn(N, K, generator=g) / K ** 0.5).to(device, dt)
    nw = (torch.rand(N, generator=g) + 0.5).to(device, dt)
    return h, attn, w, nw, {} if dt == torch.float32 else dict(rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("T,N,K", [(1, 50, 96), (5, 300, 2100), (OUT_BLOCK_T, 257, 130)])
def test_fused_out_proj_add_rms_norm_matches_reference(device, T, N, K):
    """One token; columns in three blocks, the last short, and an input width split 16 ways
    unevenly (splits left empty); a full token tile over three blocks, the last of one column.
    Twice in a row:
    the arrival counters must be back at zero."""
    h, attn, w, nw, tol = _case(device, T, N, K)
    want = out_proj_add_rms_norm_reference(h, attn, w, nw, 1e-6)
    for _ in range(2):
        got = fused_out_proj_add_rms_norm(h, attn, w, nw, 1e-6)
        torch.testing.assert_close(got[0], want[0], **tol)
        torch.testing.assert_close(got[1], want[1], **tol)


def test_fused_out_proj_add_rms_norm_rounds_where_the_three_launches_round():
    """float16 with small whole numbers, so the projection is exact in any order: h is
    bit-identical to cuBLAS's GEMM then `add_rms_norm`, and x within the sum of squares' order."""
    from zipmoe.kernels.layer_ops import add_rms_norm

    h, attn, w, nw, _ = _case("cpu", 3, 300, 2100)
    h, attn = h.round().clamp(-4, 4).half(), attn.round().clamp(-2, 2).half()
    w, nw = (w * 40).round().clamp(-1, 1).half(), nw.half()
    got = fused_out_proj_add_rms_norm(h, attn, w, nw, 1e-6)
    want = add_rms_norm(h, torch.nn.functional.linear(attn, w), nw, 1e-6)
    assert torch.equal(got[0], want[0])
    torch.testing.assert_close(got[1], want[1], rtol=1e-3, atol=1e-3)


def test_fused_out_proj_add_rms_norm_refuses_what_it_cannot_serve():
    h, attn, w, nw, _ = _case("cpu", OUT_BLOCK_T + 1, 32, 48)
    with pytest.raises(ValueError, match=f"at most {OUT_BLOCK_T} tokens"):
        fused_out_proj_add_rms_norm(h, attn, w, nw, 1e-6)
    h, attn, w, nw, _ = _case("cpu", 2, 32, 48)
    for bad in ((h, attn, w[:, :40], nw), (h[:, :30], attn, w, nw), (h, attn, w, nw[:10])):
        with pytest.raises(ValueError, match="not \\[T, N\\], \\[T, K\\], \\[N, K\\], \\[N\\]"):
            fused_out_proj_add_rms_norm(*bad, 1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 16])
def test_fused_out_proj_add_rms_norm_30b_shape_in_a_cuda_graph(T):
    """2048 x 4096 bf16: eager, then captured and replayed on new inputs written in place."""
    h, attn, w, nw, tol = _case("cuda", T, 2048, 4096)
    fused_out_proj_add_rms_norm(h, attn, w, nw, 1e-6)  # compile (and make the counters) outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = fused_out_proj_add_rms_norm(h, attn, w, nw, 1e-6)
    for seed in (1, 2):
        new_h, new_attn, *_ = _case("cuda", T, 2048, 4096, seed)
        h.copy_(new_h)
        attn.copy_(new_attn)
        graph.replay()
        want = out_proj_add_rms_norm_reference(h, attn, w, nw, 1e-6)
        torch.testing.assert_close(got[0], want[0], **tol)
        torch.testing.assert_close(got[1], want[1], **tol)
