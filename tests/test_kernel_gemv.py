"""One token's linear layer in one launch against F.linear (CPU: Triton's interpreter, float32;
GPU: bf16 at the 30B shape's output projection, and in a CUDA graph)."""
from __future__ import annotations

import pytest
import torch

from zipmoe.kernels.gemv import gemv, linear, linear_reference

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _case(device, T, N, K, seed=0):
    g = torch.Generator().manual_seed(seed)
    dt = torch.float32 if device == "cpu" else torch.bfloat16
    return (torch.randn(T, K, generator=g).to(device, dt),
            (torch.randn(N, K, generator=g) / K ** 0.5).to(device, dt))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("N,K", [(64, 96), (37, 1100), (8, 512)])
def test_gemv_matches_reference(device, N, K):
    """Rows not a multiple of the block, a width not a power of two nor of the step."""
    x, w = _case(device, 1, N, K)
    tol = dict(rtol=1e-5, atol=1e-5) if device == "cpu" else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(gemv(x, w), linear_reference(x, w), **tol)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("T", [1, 3])
def test_linear_matches_reference_either_side_of_one_token(device, T):
    x, w = _case(device, T, 48, 80)
    tol = dict(rtol=1e-5, atol=1e-5) if device == "cpu" else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(linear(x, w), linear_reference(x, w), **tol)


def test_gemv_op_schema_and_fake():
    """The one launch is the op; `linear` chooses it or cuBLAS outside any op."""
    x, w = _case("cpu", 1, 16, 32)
    torch.library.opcheck(torch.ops.zipmoe.gemv.default, (x, w), test_utils=("test_schema", "test_faketensor"))


def test_gemv_refuses_more_than_one_row():
    x, w = _case("cpu", 2, 16, 32)
    with pytest.raises(ValueError, match="one row"):
        gemv(x, w)


@pytest.mark.gpu
def test_gemv_30b_output_projection_in_a_cuda_graph():
    x, w = _case("cuda", 1, 2048, 4096)
    gemv(x, w)  # compile before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gemv(x, w)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.testing.assert_close(out.float(), linear_reference(x.float(), w.float()), rtol=2e-2, atol=2e-2)
