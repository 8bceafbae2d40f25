"""The engine on CUDA: Triton kernels and CUDA-graph decode give what the eager CUDA path gives,
and what the CPU reference gives; chained by programmatic dependent launch, what they give
without it (H200; skipped without CUDA)."""
from __future__ import annotations

import pytest
import torch

from zipmoe.engine.cuda_graphs import bucket_sizes, kept_logit_rows, prompt_buckets
from zipmoe.engine.engine import EngineConfig, LLMEngine
from zipmoe.engine.routing import OeaPolicy, RoutingPolicy, SerePolicy
from zipmoe.engine.sequence import SamplingParams
from zipmoe.kernels import dependent_launch
from zipmoe.kernels.dependent_launch import launch_options

PROMPTS = [list(range(10 + 3 * i, 40 + 5 * i)) for i in range(11)]


def test_buckets_cover_every_batch_and_split_at_routing_min_batch():
    assert bucket_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert bucket_sizes(6, routing_min_batch=5) == [1, 2, 4, 5, 6]
    assert bucket_sizes(20, routing_min_batch=12) == [1, 2, 4, 8, 11, 12, 16, 20]


def test_prompt_row_buckets_double_above_the_decode_buckets():
    assert prompt_buckets(64, 512) == [128, 256, 512]
    assert prompt_buckets(64, 300) == [128, 300]  # 256 lies within a quarter of 300
    assert prompt_buckets(64, 130) == [130]
    assert prompt_buckets(64, 100) == [100]
    assert prompt_buckets(64, 64) == prompt_buckets(64, 0) == []


def test_the_memory_plan_counts_the_logits_the_decode_graphs_keep():
    assert kept_logit_rows(64, 1, 512) == 295 + 3 * 64  # 1, 2, 4, 8, ..., 64; three prompt buckets of 64 rows
    assert kept_logit_rows(8, 1, 0) == 1 + 2 + 4 + 8


def run(checkpoint, device, policy=None, graphs=True, dtype="float32", n=len(PROMPTS), steps=16, min_batch=1):
    eng = LLMEngine(checkpoint, EngineConfig(device=device, dtype=dtype, num_kv_blocks=128, max_model_len=256,
                                             max_num_batched_tokens=1024, max_num_seqs=16, cuda_graphs=graphs,
                                             routing_min_batch=min_batch))
    if policy is not None:
        eng.set_routing_policy(policy)
    # Staggered lengths: the decode batch shrinks step by step, crossing bucket sizes.
    seqs = [eng.add_request(p, SamplingParams(max_tokens=steps - i, ignore_eos=True)) for i, p in enumerate(PROMPTS[:n])]
    while eng.has_work:
        eng.step()
    return [s.output_ids for s in seqs], eng.routing_stats.snapshot()


def sere_tables(device, layers=4, experts=16):
    g = torch.Generator().manual_seed(0)
    sim = torch.rand(layers, experts, experts, generator=g)
    sim = (sim + sim.transpose(1, 2)) / 2
    return sim.to(device), torch.zeros(layers, experts, dtype=torch.bool, device=device), {i: i for i in range(layers)}


@pytest.mark.gpu
@pytest.mark.parametrize("policy", ["topk", "sere", "oea"])
def test_cuda_graphs_match_eager_cuda(tiny_checkpoint, policy):
    def make():
        return {"topk": RoutingPolicy(), "oea": OeaPolicy(2),
                "sere": SerePolicy(*sere_tables("cuda"), primary_k=2, threshold=0.0)}[policy]

    eager_ids, eager_stats = run(tiny_checkpoint, "cuda", make(), graphs=False)
    graph_ids, graph_stats = run(tiny_checkpoint, "cuda", make(), graphs=True)
    assert graph_ids == eager_ids
    # Padding rows copy a real row: the unions and re-routed slots counted are the batch's own.
    assert graph_stats == eager_stats


@pytest.mark.gpu
def test_cuda_graphs_respect_routing_min_batch(tiny_checkpoint):
    policy = SerePolicy(*sere_tables("cuda"), primary_k=2, threshold=0.0)
    ids, stats = run(tiny_checkpoint, "cuda", policy, graphs=True, n=4, min_batch=5)
    assert stats["rerouted_slots"] == 0  # never 5 sequences at once: plain top-K throughout
    assert ids == run(tiny_checkpoint, "cuda", RoutingPolicy(), graphs=True, n=4)[0]


@pytest.mark.gpu
def test_cuda_float32_logits_match_cpu_reference(tiny_checkpoint, monkeypatch):
    """Kernels and CUDA graphs (float32) against the CPU references, compared on logits: the random
    tiny model's logits are nearly flat, so greedy tokens may flip on a last-bit difference."""
    import zipmoe.engine.runner as runner_module

    captured: dict[str, list[torch.Tensor]] = {"cpu": [], "cuda": []}
    sample = runner_module.sample
    for device in ("cpu", "cuda"):
        monkeypatch.setattr(runner_module, "sample",
                            lambda logits, seqs, d=device: captured[d].append(logits.cpu()) or sample(logits, seqs))
        # 3 sequences of 3, 2 and 1 tokens: a prefill of 3, then decode steps of 2 and 1.
        run(tiny_checkpoint, device, SerePolicy(*sere_tables(device), primary_k=2, threshold=0.0), n=3, steps=3)
    cpu, cuda = captured["cpu"], captured["cuda"]
    assert [t.shape[0] for t in cpu] == [t.shape[0] for t in cuda] == [3, 2, 1]
    torch.testing.assert_close(cuda[0], cpu[0], rtol=1e-3, atol=1e-3)  # prefill
    same = (cpu[0].argmax(-1) == cuda[0].argmax(-1))[:2]
    assert same.any()
    # The first decode step, for the sequences whose first token agreed (the same inputs on both).
    torch.testing.assert_close(cuda[1][same], cpu[1][same], rtol=1e-3, atol=1e-3)


def test_dependent_launch_is_off_without_cuda_and_when_switched_off():
    assert launch_options(torch.device("cpu")) == {"PDL": False}  # the interpreter has no grid control
    if torch.cuda.is_available():
        with dependent_launch.enabled_as(False):
            assert launch_options(torch.device("cuda")) == {"PDL": False}


@pytest.mark.gpu
@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
def test_dependent_launch_changes_no_token(tiny_checkpoint, graphs):
    """The decode step's kernels chained by PDL (each waiting for its inputs) give exactly the
    tokens they give launched one after another."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("PDL needs compute capability 9.0")
    def tokens(pdl: bool):
        with dependent_launch.enabled_as(pdl):
            return run(tiny_checkpoint, "cuda", SerePolicy(*sere_tables("cuda"), primary_k=2, threshold=0.0),
                       graphs=graphs)

    chained, plain = tokens(True), tokens(False)
    assert chained == plain
