"""Draining before a stop (drain.py): on a real server, streams on both entry models run to their last
token while new requests are refused; the drain's ending rules against a faked server."""
from __future__ import annotations

import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from conftest import tiny_server
from zipmoe import drain as drain_module
from zipmoe.clients.triton_client import ServerError, grpc_generate
from zipmoe.drain import drain
from zipmoe.openai_frontend.chat import server_error

TOKENS = 200


@pytest.mark.integration
def test_streams_in_flight_finish_and_new_requests_are_refused(tiny_checkpoint, tmp_path_factory):
    with tiny_server(tiny_checkpoint, tmp_path_factory, "drain") as server:
        # Only the server's own admin key may unload a model: no client can take one away
        unload = urllib.request.Request(f"http://{server.url_http}/v2/repository/models/mm_qa/unload", b"{}")
        with pytest.raises(urllib.error.HTTPError, match="403"):
            urllib.request.urlopen(unload, timeout=10)
        started = {model: threading.Event() for model in ("mm_qa", "mm_qa_bls")}

        def stream(model):
            responses = []
            for r in grpc_generate(server.url_grpc, model, text_input="tell me everything", max_tokens=TOKENS,
                                   ignore_eos=True, stream=True):
                responses.append(r)
                if len(responses) == 3:
                    started[model].set()
            return responses

        with ThreadPoolExecutor(3) as pool:
            streams = {model: pool.submit(stream, model) for model in started}
            assert all(event.wait(120) for event in started.values())
            drained = pool.submit(drain, server.url_http, server.url_metrics, server.admin_headers, 120,
                                  log=lambda line: None)
            deadline = time.monotonic() + 30
            while True:  # the entries are unloaded at once, their streams still running
                try:
                    list(grpc_generate(server.url_grpc, "mm_qa", text_input="hi", max_tokens=2))
                except ServerError as e:
                    refused = str(e)
                    break
                assert time.monotonic() < deadline, "mm_qa kept taking new requests while draining"
            assert not all(s.done() for s in streams.values()), "the streams ended before the drain began"
            answers = {model: s.result(timeout=120) for model, s in streams.items()}
            assert drained.result(timeout=120) == "drained"
    assert "has no available versions" in refused and server_error(refused).status == 503
    for model, responses in answers.items():
        assert responses[-1]["output_token_count"] == TOKENS and responses[-1]["finish_reason"] == "length", model


class FakeServer:
    """Entry states and decoder sequences as drain() reads them, changing on a schedule of polls."""

    def __init__(self, monkeypatch, busy_polls: int, unload_polls: float):
        self.polls, self.busy_polls, self.unload_polls, self.unloaded = 0, busy_polls, unload_polls, []
        monkeypatch.setattr(drain_module, "POLL_S", 0.01)
        monkeypatch.setattr(drain_module, "_post", lambda url, path, headers: self.unloaded.append(path))
        monkeypatch.setattr(drain_module, "entry_states", self.states)
        monkeypatch.setattr(drain_module, "decoder_sequences", self.sequences)

    def states(self, url, headers):
        state = "READY" if not self.unloaded else "UNLOADING" if self.polls < self.unload_polls else "UNAVAILABLE"
        return {"mm_qa": state, "mm_qa_bls": state}

    def sequences(self, url):
        self.polls += 1
        return 2.0 if self.polls <= self.busy_polls else 0.0


@pytest.mark.parametrize("busy_polls, unload_polls, timeout, ended", [
    (5, 6, 10, "drained"),  # both entries unloaded once their requests finished
    (5, float("inf"), 10, "quiet"),  # an entry a failed gRPC request holds: the decoder's idleness ends it
    (10**9, float("inf"), 0.2, "timeout"),
])
def test_how_a_drain_ends(monkeypatch, busy_polls, unload_polls, timeout, ended):
    fake = FakeServer(monkeypatch, busy_polls, unload_polls)
    assert drain("http", "metrics", {}, timeout, quiet_s=0.1, log=lambda line: None) == ended
    assert fake.unloaded == ["/v2/repository/models/mm_qa/unload", "/v2/repository/models/mm_qa_bls/unload"]


def test_a_drain_told_to_stop_ends_at_once(monkeypatch):
    FakeServer(monkeypatch, 10**9, float("inf"))
    assert drain("http", "metrics", {}, 10, running=lambda: False, log=lambda line: None) == "stopped"
