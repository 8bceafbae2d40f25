"""Data parallel on a real tritonserver, on the CPU: moe_decoder and vision_encoder with two instances
each (`instance_group [{ count: 2 kind: KIND_CPU }]` through the repository overrides; on a GPU host
`[{ count: 1 kind: KIND_GPU gpus: [0, 1] }]` puts one of each on each GPU). Concurrent requests on both
pipelines get the greedy answers a single instance gives, Triton spreads them over both decoders
(their metrics carry the instance), and each decoder writes its own slot of the degradation level."""
from __future__ import annotations

import re
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from test_images_server import note
from conftest import tiny_server
from zipmoe.clients.triton_client import grpc_generate
from zipmoe.serving.shared_level import segment_path, slots
from zipmoe.supervisor import stub_pids

pytestmark = pytest.mark.integration
TWO = "[{ count: 2 kind: KIND_CPU }]"
DECODERS = {"moe_decoder_0_0", "moe_decoder_0_1"}  # Triton's names: group moe_decoder_0, instances 0 and 1
REQUESTS = [dict(text_input=q) for q in ("What is the total on the receipt?", "Which note mentions coffee?",
                                         "Count the red shapes.", "Compare the two price tags.",
                                         "Read the table, row two.", "你好，这是什么？")]
REQUESTS += [dict(text_input="What do these notes say?", images=[note(i), note(i + 1)]) for i in range(4)]
COMPLETED = re.compile(r'^zipmoe_requests_completed_total\{([^}]*)\} (\S+)$', re.M)


@pytest.fixture(scope="module")
def two_decoders(tiny_checkpoint, tmp_path_factory):
    overrides = {"moe_decoder": {"instance_group": TWO}, "vision_encoder": {"instance_group": TWO}}
    with tiny_server(tiny_checkpoint, tmp_path_factory, "two_decoders", overrides) as s:
        yield s


def answer(server, model: str, request: dict) -> tuple:
    last = list(grpc_generate(server.url_grpc, model=model, max_tokens=16, ignore_eos=True, **request))[-1]
    return last["text_output"], last["output_token_count"], list(last["visual_tokens_kept"])


def completed_by_instance(server) -> dict[str, float]:
    """moe_decoder's zipmoe_requests_completed_total per instance label."""
    with urllib.request.urlopen(f"http://{server.url_metrics}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {dict(kv.split("=", 1) for kv in labels.split(","))["instance"].strip('"'): float(value)
            for labels, value in COMPLETED.findall(text) if 'model="moe_decoder"' in labels}


@pytest.mark.parametrize("model", ["mm_qa", "mm_qa_bls"])
def test_concurrent_requests_on_two_decoders_get_the_answers_of_one(two_decoders, zipmoe_server, model):
    reference = [answer(zipmoe_server, model, r) for r in REQUESTS]  # one instance, one request at a time
    before = completed_by_instance(two_decoders)
    with ThreadPoolExecutor(len(REQUESTS)) as pool:
        got = list(pool.map(lambda r: answer(two_decoders, model, r), REQUESTS))
    assert got == reference
    served = {name: n - before.get(name, 0) for name, n in completed_by_instance(two_decoders).items()}
    assert set(served) == DECODERS and sum(served.values()) == len(REQUESTS)
    assert all(n > 0 for n in served.values()), f"Triton sent every request to one decoder: {served}"


def test_each_decoder_claims_its_own_level_slot(two_decoders):
    segment = segment_path(two_decoders._workdir / "model_repository" / "moe_decoder")
    claimed = {pid for pid, _ in slots(segment.read_bytes()) if pid}
    decoders = {pid for pid, name in stub_pids(two_decoders.process.pid).items() if name in DECODERS}
    assert len(decoders) == 2 and claimed == decoders
