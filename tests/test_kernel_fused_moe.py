"""Fused MoE kernels against the per-expert reference (CPU: Triton interpreter, float32; GPU: bf16)."""
from __future__ import annotations

import pytest
import torch

from zipmoe.kernels.layer_ops import router_reference
from zipmoe.kernels.fused_moe import (MoeConfig, down_per_slot, pick_config, fused_experts, fused_experts_per_slot,
                                      fused_experts_reference, fused_experts_with_config)
from zipmoe.kernels.moe_align import moe_align, moe_align_reference, num_tiles

SMALL = MoeConfig(block_m=16, block_n=32, block_k=32, num_warps=4, num_stages=1)


def _case(T, E, K, H, I, dtype=torch.float32, device="cpu", seed=0, duplicates=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g)
    gate = torch.randn(E, H, generator=g) / H ** 0.5
    gate_up = torch.randn(E, 2 * I, H, generator=g) / H ** 0.5
    down = torch.randn(E, I, H, generator=g) / I ** 0.5
    _, ids, weights = router_reference(x, gate, K, normalize=True)
    if duplicates:  # what SERE can produce: a secondary slot moved onto the token's own primary
        ids[::2, -1] = ids[::2, 0]
    to = dict(device=device)
    return (x.to(dtype=dtype, **to), ids.to(**to), weights.to(dtype=dtype, **to),
            gate_up.to(dtype=dtype, **to), down.to(dtype=dtype, **to))


@pytest.mark.parametrize("T,E,K", [(1, 16, 4), (7, 16, 4), (40, 8, 2), (3, 128, 8), (128, 128, 8), (256, 64, 8),
                                   (600, 128, 8)])  # a prefill chunk: 4,800 slots
def test_moe_align_matches_reference(T, E, K):
    ids = torch.randint(0, E, (T, K), generator=torch.Generator().manual_seed(T))
    for block_m in (16, 64):
        slots, experts = moe_align(ids, E, block_m)
        ref_slots, ref_experts = moe_align_reference(ids, E, block_m)
        assert torch.equal(experts, ref_experts) and torch.equal(slots, ref_slots)
        assert experts.numel() == num_tiles(T * K, E, block_m)
        # every slot appears exactly once, in a tile of its own expert
        used = slots[slots < T * K].long()
        assert torch.equal(used.sort().values, torch.arange(T * K))
        tile_of = torch.div(torch.nonzero(slots < T * K)[:, 0], block_m, rounding_mode="floor")
        assert torch.equal(experts[tile_of].long(), ids.reshape(-1)[used])


@pytest.mark.gpu
@pytest.mark.parametrize("T", [300, 1024])  # 2,400 and 8,192 slots: prefill chunks, 16 warps a program
def test_moe_align_matches_reference_for_a_prefill_chunk_gpu(T):
    ids = torch.randint(0, 128, (T, 8), generator=torch.Generator().manual_seed(T)).cuda()
    for block_m in (16, 64):
        got, want = moe_align(ids, 128, block_m), moe_align_reference(ids, 128, block_m)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("T,E,K,H,I,dup", [(1, 16, 4, 64, 32, False), (5, 16, 4, 48, 40, True),
                                            (19, 8, 2, 64, 32, False)])
def test_fused_experts_matches_reference(T, E, K, H, I, dup):
    x, ids, w, gate_up, down = _case(T, E, K, H, I, duplicates=dup)
    out = fused_experts_with_config(x, ids, w, gate_up, down, SMALL)
    torch.testing.assert_close(out, fused_experts_reference(x, ids, w, gate_up, down), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(fused_experts(x, ids, w, gate_up, down), out, rtol=1e-4, atol=1e-4)
    per_slot = fused_experts_per_slot(x, ids, w, gate_up, down)  # the engine's launch: the sum left to add_rms_norm
    assert per_slot.shape == (T, K, H)
    assert torch.equal(per_slot.sum(dim=1), fused_experts(x, ids, w, gate_up, down))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("dup", [False, True])
def test_one_token_with_distinct_ids_skips_the_align(device, dup, monkeypatch):
    """One token whose ids the caller calls distinct: each slot is its own tile, no align launch,
    and the same slot outputs as the aligned path. A repeated id (a caller's wrong hint) is still
    right, its expert merely read twice."""
    import zipmoe.kernels.fused_moe as fm

    dt = torch.float32 if device == "cpu" else torch.bfloat16
    x, ids, w, gate_up, down = _case(1, 16, 4, 64, 32, dt, device, duplicates=dup)
    aligned = fused_experts_per_slot(x, ids, w, gate_up, down)
    monkeypatch.setattr(fm, "moe_align", lambda *a: pytest.fail("aligned a single token's distinct ids"))
    direct = fused_experts_per_slot(x, ids, w, gate_up, down, distinct_ids=True)
    assert torch.equal(direct, aligned)
    monkeypatch.undo()
    x, ids, w, gate_up, down = _case(3, 16, 4, 64, 32, dt, device)
    assert torch.equal(fused_experts_per_slot(x, ids, w, gate_up, down, distinct_ids=True),
                       fused_experts_per_slot(x, ids, w, gate_up, down))  # more tokens: aligned as ever


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_down_loads_rows_ahead_once_ready_and_after_the_wait_without(device):
    """One token's slots with the routing's ready word: raised, each program loads its first rows
    of the expert before its wait; never raised, it stops asking after READY_TRIES and loads them
    after the wait. The same slot outputs either way (a dropped slot's zero), and those of the
    program that loads nothing ahead up to the order of its sums."""
    dt = torch.float32 if device == "cpu" else torch.bfloat16
    _, ids, w, _, down = _case(1, 16, 4, 64, 160, dt, device)
    hidden = torch.randn(4, 160, generator=torch.Generator().manual_seed(1)).to(device, dt)
    tiles = ids.clone()
    tiles[0, -1] = -1  # a slot the routing dropped
    args = (hidden, down, w, tiles, tiles.reshape(-1), SMALL, True)
    plain = down_per_slot(*args)
    raised, never = (down_per_slot(*args, ready=torch.full((1,), flag, dtype=torch.int32, device=device))
                     for flag in (1, 0))
    assert torch.equal(raised, never) and not raised[3].any()
    torch.testing.assert_close(raised, plain, **({} if dt == torch.float32 else dict(rtol=2e-2, atol=2e-2)))


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 4, 16, 64, 128, 1000])
@pytest.mark.parametrize("dup", [False, True])
def test_fused_experts_matches_reference_gpu_30b_shape(T, dup):
    x, ids, w, gate_up, down = _case(T, 128, 8, 2048, 768, torch.bfloat16, "cuda", duplicates=dup)
    ref = fused_experts_reference(x.float(), ids, w.float(), gate_up.float(), down.float())
    for cfg in {pick_config(n, 128, 2048, 768) for n in (1, 16, 64, 128, 1000)}:
        out = fused_experts_with_config(x, ids, w, gate_up, down, cfg)
        torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(fused_experts(x, ids, w, gate_up, down).float(), ref, rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
def test_fused_experts_replays_in_a_cuda_graph():
    x, ids, w, gate_up, down = _case(16, 128, 8, 256, 128, torch.bfloat16, "cuda")
    static = [t.clone() for t in (x, ids, w)]
    fused_experts(*static, gate_up, down)  # compile before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_experts(*static, gate_up, down)
    x2, ids2, w2, _, _ = _case(16, 128, 8, 256, 128, torch.bfloat16, "cuda", seed=1)
    for buf, new in zip(static, (x2, ids2, w2)):
        buf.copy_(new)
    graph.replay()
    ref = fused_experts_reference(x2.float(), ids2, w2.float(), gate_up.float(), down.float())
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)
