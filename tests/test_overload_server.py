"""Overload on a real tritonserver: moe_decoder runs one sequence and lets two wait
(max_waiting_requests 2), so a burst beyond that is refused "server busy" on every path (gRPC and
HTTP generate, mm_qa and mm_qa_bls, the OpenAI frontend), the waiting requests are answered in full,
nothing hangs, and the server keeps answering.

What server 2.51 shows a client of the busy error (moe_decoder sets Triton's UNAVAILABLE code): over
gRPC the stream's error message only (no status code on a stream); over HTTP generate the message,
with a status that does not follow the code (400 here: see models/io.py error_response); through
mm_qa the ensemble prefixes "in ensemble 'mm_qa', "; through mm_qa_bls the message unchanged. The
OpenAI frontend answers 503 with Retry-After."""
from __future__ import annotations

import queue
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from conftest import tiny_server
from zipmoe import serve
from zipmoe.clients.triton_client import ServerBusy, grpc_generate, http_generate, scrape_metrics
from zipmoe.openai_frontend.server import OpenAIFrontend

pytestmark = pytest.mark.integration
BUSY = "server busy: 2 requests waiting in moe_decoder (max_waiting_requests 2); retry later"
TOKENS = 6


@pytest.fixture(scope="module")
def busy_server(tiny_checkpoint, tmp_path_factory):
    overrides = {"moe_decoder": {"max_waiting_requests": "2", "max_num_seqs": "1", "max_tokens_cap": "4000"}}
    with tiny_server(tiny_checkpoint, tmp_path_factory, "busy_server", overrides) as s:
        with OpenAIFrontend(s.url_grpc, port=serve.free_port()) as frontend:
            s.openai_url = frontend.url
            yield s


def hold_the_seat(server) -> grpcclient.InferenceServerClient:
    """A long request straight to moe_decoder, decoding (so it takes the one seat) when this returns."""
    client, got = grpcclient.InferenceServerClient(server.url_grpc), queue.Queue()
    client.start_stream(callback=lambda result, error: got.put(error))
    inputs = []
    for name, dtype, value in [("input_ids", "INT32", np.arange(5, 12, dtype=np.int32)),
                               ("max_tokens", "INT32", np.array([4000], np.int32)),
                               ("ignore_eos", "BOOL", np.array([True])), ("stream", "BOOL", np.array([True]))]:
        tensor = grpcclient.InferInput(name, list(value.shape), dtype)
        tensor.set_data_from_numpy(value)
        inputs.append(tensor)
    client.async_stream_infer("moe_decoder", inputs)
    for _ in range(3):
        assert got.get(timeout=60) is None
    return client


def ask(server, path: str, i: int) -> str:
    """One request by `path`: "answered" (all TOKENS tokens) or "busy" (refused so); anything else fails."""
    question = dict(text_input=f"Question {i}: what is on note {i}?", max_tokens=TOKENS, ignore_eos=True)
    try:
        if path == "openai":
            r = httpx.post(server.openai_url + "/chat/completions", timeout=120, json={
                "model": "mm_qa", "max_tokens": TOKENS, "ignore_eos": True,
                "messages": [{"role": "user", "content": question["text_input"]}]})
            if r.status_code == 503:
                assert r.headers["retry-after"] == "1" and BUSY in r.json()["error"]["message"]
                return "busy"
            assert r.json()["usage"]["completion_tokens"] == TOKENS
            return "answered"
        protocol, model = path.split(":")
        if protocol == "http":
            answer = http_generate(server.url_http, model=model, timeout=120, **question)
        else:
            answer = list(grpc_generate(server.url_grpc, model=model, timeout=120, stream=True, **question))[-1]
        assert answer["output_token_count"] == TOKENS
        return "answered"
    except ServerBusy as e:
        assert str(e) in (BUSY, f"in ensemble 'mm_qa', {BUSY}")
        return "busy"


PATHS = ["grpc:mm_qa", "grpc:mm_qa_bls", "http:mm_qa", "http:mm_qa_bls", "openai"]


def rejected(server) -> float:
    return scrape_metrics(server.url_metrics).get("zipmoe_requests_rejected_busy_total", 0.0)


def test_beyond_two_waiting_every_path_is_refused_busy_and_the_two_are_answered(busy_server):
    before = rejected(busy_server)
    holder = hold_the_seat(busy_server)
    burst = [PATHS[i % len(PATHS)] for i in range(15)]
    with ThreadPoolExecutor(len(burst)) as pool:
        outcomes = [pool.submit(ask, busy_server, path, i) for i, path in enumerate(burst)]
        deadline = time.monotonic() + 60
        while sum(o.done() for o in outcomes) < len(burst) - 2:  # the refused come back at once
            assert time.monotonic() < deadline, "refusals should not wait"
            time.sleep(0.05)
        holder.stop_stream(cancel_requests=True)  # frees the seat: the two waiting ones go on
        holder.close()
        results = [o.result(timeout=120) for o in outcomes]
    assert results.count("answered") == 2 and results.count("busy") == 13
    assert {path for path, result in zip(burst, results) if result == "busy"} == set(PATHS)
    deadline = time.monotonic() + 10  # moe_decoder publishes its counters from its engine thread
    while rejected(busy_server) - before < 13:
        assert time.monotonic() < deadline, "zipmoe_requests_rejected_busy_total did not count the refusals"
        time.sleep(0.1)


def test_a_burst_without_a_holder_is_answered_or_refused_and_nothing_hangs(busy_server):
    with ThreadPoolExecutor(10) as pool:
        results = list(pool.map(lambda i: ask(busy_server, PATHS[i % 2], i), range(10)))
    assert set(results) <= {"answered", "busy"} and "answered" in results
    assert ask(busy_server, "grpc:mm_qa", 99) == "answered"  # still serving, the queue empty again
