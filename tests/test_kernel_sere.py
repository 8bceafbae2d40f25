"""SERE re-route kernel: bit-identical ids to the reference (CPU: Triton interpreter; GPU: CUDA)."""
from __future__ import annotations

import itertools

import pytest
import torch

from zipmoe.kernels.sere_reroute import launch_sere, sere_reroute, sere_reroute_reference


def _case(T, K, E, seed, device="cpu", ties=False):
    g = torch.Generator().manual_seed(seed)
    ids = torch.rand(T, E, generator=g).argsort(dim=1)[:, :K]  # distinct experts per token
    sim = torch.rand(E, E, generator=g) * 2 - 1
    if ties:  # few distinct values: the most similar primary is often a tie (lowest id wins)
        sim = (sim * 2).round() / 2
    sim = (sim + sim.T) / 2
    sim.fill_diagonal_(1.0)
    protect = torch.rand(E, generator=g) < 0.15
    opt_out = torch.rand(T, generator=g) < 0.2
    return [t.to(device) for t in (ids, sim.float(), protect, opt_out)]


CASES = list(itertools.product([1, 5, 16, 33], [(4, 16), (8, 128)], [1, 2, 3], [0.0, 0.5]))


@pytest.mark.parametrize("T,KE,k1,rho", CASES)
def test_sere_reroute_matches_reference_bit_exact(T, KE, k1, rho):
    K, E = KE
    ids, sim, protect, opt_out = _case(T, K, E, seed=T * 7 + k1, ties=rho == 0.0)
    for oo in (None, opt_out):
        got = sere_reroute(ids, sim, protect, oo, k1, rho)
        assert torch.equal(got, sere_reroute_reference(ids, sim, protect, oo, k1, rho))


def test_sere_reroute_threshold_above_every_similarity_moves_nothing():
    ids, sim, protect, _ = _case(16, 8, 128, seed=3)
    assert torch.equal(sere_reroute(ids, sim, protect, None, 2, 1.5), ids)


@pytest.mark.parametrize("block_t,num_warps", [(2, 2), (4, 4), (16, 4)])
def test_every_launch_shape_gives_the_reference_ids(block_t, num_warps):
    """The benchmark's other launch shapes (several tokens per program) re-route alike."""
    for T, k1 in [(1, 2), (5, 1), (33, 3)]:
        ids, sim, protect, opt_out = _case(T, 8, 128, seed=T + k1, ties=True)
        got = launch_sere(ids, sim, protect, opt_out, k1, 0.0, block_t=block_t, num_warps=num_warps)
        assert torch.equal(got, sere_reroute_reference(ids, sim, protect, opt_out, k1, 0.0))


def test_an_empty_batch_launches_nothing():
    ids, sim, protect, _ = _case(1, 8, 128, seed=0)
    assert sere_reroute(ids[:0], sim, protect, None, 2, 0.5).shape == (0, 8)
    with pytest.raises(ValueError, match="primary_k"):
        launch_sere(ids, sim, protect, None, 0, 0.5)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("E", [16, 60, 128])
@pytest.mark.parametrize("num_warps", [1, 2, 4])
def test_small_batches_match_the_reference_gpu(T, E, num_warps):
    """Fewer primary ids than threads (the histogram's input is shorter than the program's lanes),
    and expert counts that are not powers of two."""
    for seed, rho in [(0, 0.0), (1, 0.5)]:
        ids, sim, protect, opt_out = _case(T, 8, E, seed, "cuda", ties=seed == 0)
        got = launch_sere(ids, sim, protect, opt_out, 2, rho, num_warps=num_warps)
        assert torch.equal(got, sere_reroute_reference(ids, sim, protect, opt_out, 2, rho))


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 16, 64, 128, 300])
def test_sere_reroute_matches_reference_bit_exact_gpu(T):
    for seed, rho in [(0, 0.0), (1, 0.3), (2, 0.5)]:
        ids, sim, protect, opt_out = _case(T, 8, 128, seed, "cuda", ties=seed == 0)
        got = sere_reroute(ids, sim, protect, opt_out, 2, rho)
        assert torch.equal(got, sere_reroute_reference(ids, sim, protect, opt_out, 2, rho))
