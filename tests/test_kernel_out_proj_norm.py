"""The attention's output projection + residual add + RMSNorm in one launch, against its reference
(CPU: Triton's interpreter, float32; GPU: bf16 at Qwen3-30B-A3B's shape, and in a CUDA graph)."""
from __future__ import annotations

import pytest
import torch

from zipmoe.kernels.out_proj_norm import OUT_MAX_T, out_proj_add_rms_norm, out_proj_add_rms_norm_reference

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
@pytest.mark.parametrize("T,N,K", [(1, 50, 96), (5, 48, 300), (OUT_MAX_T, 80, 64), (OUT_MAX_T + 3, 64, 96)])
def test_out_proj_add_rms_norm_matches_reference(device, T, N, K):
    """One token, columns and input width not multiples of the tiles, rows in several norm chunks,
    and the cuBLAS path past OUT_MAX_T; twice in a row: the arrival counter must be back at zero."""
    h, attn, w, nw, tol = _case(device, T, N, K)
    want = out_proj_add_rms_norm_reference(h, attn, w, nw, 1e-6)
    for _ in range(2):
        got = out_proj_add_rms_norm(h, attn, w, nw, 1e-6)
        torch.testing.assert_close(got[0], want[0], **tol)
        torch.testing.assert_close(got[1], want[1], **tol)


def test_out_proj_add_rms_norm_op_schema_and_fake():
    h, attn, w, nw, _ = _case("cpu", 3, 32, 48)
    torch.library.opcheck(torch.ops.zipmoe.out_proj_add_rms_norm.default, (h, attn, w, nw, 1e-6),
                          test_utils=("test_schema", "test_faketensor"))


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 16])
def test_out_proj_add_rms_norm_30b_shape_in_a_cuda_graph(T):
    """2048 x 4096 bf16: eager, then captured and replayed on new inputs written in place."""
    h, attn, w, nw, tol = _case("cuda", T, 2048, 4096)
    out_proj_add_rms_norm(h, attn, w, nw, 1e-6)  # compile (and make the counter) outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = out_proj_add_rms_norm(h, attn, w, nw, 1e-6)
    for seed in (1, 2):
        new_h, new_attn, *_ = _case("cuda", T, 2048, 4096, seed)
        h.copy_(new_h)
        attn.copy_(new_attn)
        graph.replay()
        want = out_proj_add_rms_norm_reference(h, attn, w, nw, 1e-6)
        torch.testing.assert_close(got[0], want[0], **tol)
        torch.testing.assert_close(got[1], want[1], **tol)
