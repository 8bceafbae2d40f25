"""The load-adaptive keep ratio on a real tritonserver: moe_decoder's ttft_target_ms is 1 ms, so
text requests sent back to back hold the pressure above 1 and the level climbs to the top. Then, on
both pipelines, a request of priority 0 keeps keep_ratio (0.6) and requests of priority 1 and 2 get
keep_ratio_min (0.3): reported in their responses, with fewer visual tokens; the metrics show the
level, the pressure, the keep ratios used and the degraded requests by priority."""
from __future__ import annotations

import re
import threading
import time
import urllib.request

import pytest

from test_images_server import note
from conftest import tiny_server
from zipmoe.clients.triton_client import grpc_generate
from zipmoe.serving.load import MAX_LEVEL

pytestmark = pytest.mark.integration
SAMPLE = re.compile(r'^(zipmoe_[a-z_]+)\{([^}]*)\} (\S+)$')


@pytest.fixture(scope="module")
def degrading_server(tiny_checkpoint, tmp_path_factory):
    with tiny_server(tiny_checkpoint, tmp_path_factory, "degrading_server", {"moe_decoder": {"ttft_target_ms": "1"}}) as s:
        yield s


def metrics(server) -> dict[tuple[str, frozenset], float]:
    """(name, labels other than model ... as 'key="value"' strings) -> value, summed over models."""
    with urllib.request.urlopen(f"http://{server.url_metrics}/metrics", timeout=10) as r:
        lines = r.read().decode().splitlines()
    out: dict[tuple[str, frozenset], float] = {}
    for m in filter(None, map(SAMPLE.match, lines)):
        labels = frozenset(x for x in m.group(2).split(",") if x and not x.startswith("model="))
        out[(m.group(1), labels)] = out.get((m.group(1), labels), 0.0) + float(m.group(3))
    return out


def degraded(server, priority: int) -> float:
    return metrics(server).get(("zipmoe_degraded_requests_total", frozenset({f'priority="{priority}"'})), 0.0)


def ask(server, model: str, priority: int) -> dict:
    return list(grpc_generate(server.url_grpc, model=model, text_input="What do these notes say?",
                              images=[note(0), note(1), note(2)], max_tokens=2, ignore_eos=True, stream=True,
                              priority=priority))[-1]


def test_under_pressure_priorities_1_and_2_get_keep_ratio_min_and_priority_0_keeps_keep_ratio(degrading_server):
    server, stop = degrading_server, threading.Event()

    def pressure():  # every first token is over the 1 ms target
        while not stop.is_set():
            list(grpc_generate(server.url_grpc, text_input="Hello?", max_tokens=2, ignore_eos=True))

    thread = threading.Thread(target=pressure, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 120
        while metrics(server).get(("zipmoe_degradation_level", frozenset())) != MAX_LEVEL:
            assert time.monotonic() < deadline, "the level never reached the top"
            time.sleep(0.2)
        assert metrics(server)[("zipmoe_load_pressure", frozenset())] >= 1
        for model in ("mm_qa", "mm_qa_bls"):
            before = {p: degraded(server, p) for p in (1, 2)}
            answers = {p: ask(server, model, p) for p in (0, 1, 2)}
            assert answers[0]["visual_keep_ratio_used"] == pytest.approx(0.6)
            assert answers[1]["visual_keep_ratio_used"] == answers[2]["visual_keep_ratio_used"] == pytest.approx(0.3)
            full, low = sum(answers[0]["visual_tokens_kept"]), sum(answers[2]["visual_tokens_kept"])
            assert low < full and answers[2]["input_token_count"] == answers[0]["input_token_count"] - (full - low)
            assert all(a["output_token_count"] == 2 for a in answers.values())
            # counted by the model that chose the keep ratio (vision_encoder for mm_qa, mm_qa_bls itself)
            assert {p: degraded(server, p) - before[p] for p in (1, 2)} == {1: 1, 2: 1}, model
    finally:
        stop.set()
        thread.join(60)
    counts = metrics(server)
    assert counts[("zipmoe_visual_keep_ratio_count", frozenset())] == 6
    assert counts[("zipmoe_visual_keep_ratio_bucket", frozenset({'le="0.3"'}))] == 4  # priorities 1 and 2, twice
