"""Expert parallelism: the shards' outputs sum to the whole layer's, and an engine split over two
processes (gloo on the CPU, NCCL on two GPUs) gives one process's tokens."""
from __future__ import annotations

import pytest
import torch

from zipmoe.engine.engine import EngineConfig, LLMEngine
from zipmoe.engine.expert_parallel import ExpertShard
from zipmoe.engine.multimodal import VisualInputs
from zipmoe.engine.parallel_engine import ExpertParallelEngine, make_engine
from zipmoe.engine.sequence import SamplingParams
from zipmoe.kernels.fused_moe import fused_experts_reference


def test_shards_sum_to_the_whole_layer():
    g = torch.Generator().manual_seed(0)
    T, H, I, E, K = 9, 32, 16, 8, 3
    x = torch.randn(T, H, generator=g)
    gate_up, down = torch.randn(E, 2 * I, H, generator=g) * 0.1, torch.randn(E, I, H, generator=g) * 0.1
    ids = torch.randint(0, E, (T, K), generator=g)
    ids[0, 1] = ids[0, 0]  # a duplicate slot, as a routing policy may make
    weights = torch.rand(T, K, generator=g)
    whole = fused_experts_reference(x, ids, weights, gate_up, down)
    for size in (2, 4):
        total = torch.zeros_like(whole)
        for rank in range(size):
            shard = ExpertShard(rank, size, E)
            local_ids, local_weights = shard.localize(ids, weights)
            assert local_ids.min() >= 0 and local_ids.max() < shard.count
            total += fused_experts_reference(x, local_ids, local_weights, shard.own(gate_up), shard.own(down))
        torch.testing.assert_close(total, whole, rtol=1e-5, atol=1e-6)


def test_a_size_that_does_not_divide_the_experts_is_refused(tiny_checkpoint):
    with pytest.raises(ValueError, match="must divide"):
        ExpertShard(0, 3, 16)
    with pytest.raises(ValueError, match="must divide the model's 16 experts"):
        LLMEngine(tiny_checkpoint, _config("cpu", expert_parallel_size=3))
    with pytest.raises(ValueError, match="make_engine"):
        LLMEngine(tiny_checkpoint, _config("cpu", expert_parallel_size=2))


def _requests(text, n_images: int = 2):
    """Greedy text, sampled with a seed, greedy again (aborted midway) and a prompt with image tokens."""
    g = torch.Generator().manual_seed(1)
    V = 6 * n_images
    ids = [5, 6, 7] + [text.image_token_id] * V + [8, 9]
    visual = VisualInputs(embeds=torch.randn(V, text.hidden_size, generator=g),
                          deepstack=torch.randn(text.deepstack_layers, V, text.hidden_size, generator=g) * 0.1
                          if text.deepstack_layers else None,
                          positions=torch.arange(len(ids)).expand(3, -1), rope_delta=0)
    return [([11, 12, 13, 14], SamplingParams(max_tokens=12, ignore_eos=True), None),
            ([21, 22], SamplingParams(max_tokens=10, temperature=0.8, seed=7, ignore_eos=True), None),
            ([31, 32, 33], SamplingParams(max_tokens=9, ignore_eos=True), None),
            (ids, SamplingParams(max_tokens=8, ignore_eos=True), visual)]


def _run(engine, requests, abort_index: int = 2, abort_after: int = 3):
    seqs = [engine.add_request(ids, params, visual=visual) for ids, params, visual in requests]
    steps = 0
    while engine.has_work:
        engine.step()
        steps += 1
        if steps == abort_after:
            engine.abort(seqs[abort_index])
    return [list(s.output_ids) for s in seqs]


def _config(device: str, expert_parallel_size: int = 1) -> EngineConfig:
    # One step at a time in both: expert parallel never pipelines, and _run aborts after a step count.
    return EngineConfig(device=device, num_kv_blocks=64, max_model_len=256, max_num_batched_tokens=256,
                        expert_parallel_size=expert_parallel_size, async_scheduling=False)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_two_processes_give_one_process_tokens(tiny_checkpoint, device):
    if device == "cuda" and torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    one = LLMEngine(tiny_checkpoint, _config(device))
    expected = _run(one, _requests(one.text))
    del one
    engine = make_engine(tiny_checkpoint, _config(device, expert_parallel_size=2))
    assert isinstance(engine, ExpertParallelEngine)
    try:
        assert engine.model.layers[0].gate_up.shape[0] == engine.text.num_experts // 2  # half the experts here
        got = _run(engine, _requests(engine.text))
        with pytest.raises(NotImplementedError):
            engine.set_routing_policy(None)
    finally:
        engine.close()
    assert got == expected
    assert len(got[2]) < 9  # the aborted request stopped early, in both runs
