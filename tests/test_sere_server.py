"""SERE in the served engine: a smaller mean expert union for a real batch, and the per-request opt-out."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from zipmoe.clients.triton_client import scrape_metrics
from zipmoe.clients.triton_client import grpc_generate

pytestmark = pytest.mark.integration

QUESTIONS = [f"Question {i}: what does note {i} say about the price of item {i * 7}?" for i in range(16)]
COUNTERS = {name: f"zipmoe_moe_{name}_total" for name in ("layer_steps", "union_before", "union_after",
                                                         "rerouted_slots")}


def batch_routing(server, **extra) -> dict[str, float]:
    """Routing counters added by 16 concurrent streams."""
    before = scrape_metrics(server.url_metrics)

    def one(q):
        return list(grpc_generate(server.url_grpc, stream=True, text_input=q, max_tokens=16, ignore_eos=True, **extra))

    with ThreadPoolExecutor(len(QUESTIONS)) as pool:
        list(pool.map(one, QUESTIONS))
    after = scrape_metrics(server.url_metrics)
    return {name: after[metric] - before.get(metric, 0.0) for name, metric in COUNTERS.items()}


def test_sere_reads_fewer_experts_than_topk(sere_server):
    d = batch_routing(sere_server)
    assert d["layer_steps"] > 0
    mean_before = d["union_before"] / d["layer_steps"]  # what plain top-K would have read
    mean_after = d["union_after"] / d["layer_steps"]
    assert d["rerouted_slots"] > 0
    assert mean_after < mean_before


def test_opt_out_keeps_top_k(sere_server):
    d = batch_routing(sere_server, sere=False)
    assert d["layer_steps"] > 0 and d["rerouted_slots"] == 0
    assert d["union_after"] == d["union_before"]
