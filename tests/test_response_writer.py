"""serving.response_writer.ResponseWriter: responses delivered in order per request off the caller's
thread, a cancelled client, a failed send and a failed cancellation check (logged) reported to the
engine thread, everything delivered at close and after it; and DecoderService's engine running
ahead of a client that has not taken its responses yet, and answering whatever its metrics do."""
from __future__ import annotations

import threading
import time

from zipmoe.detokenize import TokenBytes
from zipmoe.engine.engine import EngineConfig, LLMEngine
from zipmoe.serving.decode_request import DecodeRequest
from zipmoe.serving.decoder import DecoderService
from zipmoe.serving.response_writer import CANCELLED, GONE, ResponseWriter

from test_decoder_service import PROMPT, Sink, make_service


class FailingSink(Sink):
    def __init__(self):
        super().__init__()
        self.tried = threading.Event()

    def send(self, response, final):
        self.tried.set()
        raise RuntimeError("the client went away")


def wait_for(condition, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_each_keys_responses_arrive_in_order_and_close_delivers_everything():
    writer = ResponseWriter(threads=3)
    sinks = [Sink() for _ in range(5)]
    for i in range(200):
        for key, sink in enumerate(sinks):
            writer.send(key, sink, (key, i), final=i == 199)
    writer.close()
    for key, sink in enumerate(sinks):
        assert sink.responses == [(key, i) for i in range(200)] and sink.finals == 1


def test_a_cancelled_client_is_reported_once_and_no_longer_polled():
    writer = ResponseWriter(threads=2, poll_s=0.001)
    sink, other = Sink(cancel_after=0), Sink()
    writer.watch(7, sink)
    writer.watch(8, other)
    stopped = {}
    wait_for(lambda: stopped.update(writer.take_stopped()) or 7 in stopped)
    time.sleep(0.01)
    assert stopped == {7: CANCELLED} and writer.take_stopped() == {}
    writer.close()


class UnaskableSink(Sink):
    """A response sender whose is_cancelled() raises (the server could not be asked)."""

    def is_cancelled(self):
        raise RuntimeError("no answer from the server")


def test_an_is_cancelled_that_raises_stops_the_request_and_is_logged():
    logged = []
    writer = ResponseWriter(threads=1, poll_s=0.001, log=logged.append)
    writer.watch(4, UnaskableSink())
    stopped = {}
    wait_for(lambda: stopped.update(writer.take_stopped()) or 4 in stopped)
    writer.close()
    assert stopped == {4: CANCELLED}
    assert len(logged) == 1 and "is_cancelled() failed" in logged[0] and "no answer from the server" in logged[0]


def test_what_is_handed_over_after_close_is_still_delivered():
    writer = ResponseWriter(threads=2)
    writer.close()
    sink = Sink()
    writer.watch(3, sink)
    writer.send(3, sink, "late", final=True)
    assert sink.responses == ["late"] and sink.finals == 1


def test_a_failed_send_reports_gone_drops_the_rest_of_that_request_and_is_logged():
    logged = []
    writer = ResponseWriter(threads=1, log=logged.append)
    failing, fine = FailingSink(), Sink()
    writer.send(1, failing, "a", final=False)
    writer.send(1, failing, "b", final=False)
    writer.send(2, fine, "c", final=True)
    writer.send_error(1, failing, "late error")  # dropped too: its client is gone
    writer.close()
    assert writer.take_stopped() == {1: GONE}
    assert failing.errors == [] and fine.responses == ["c"]
    assert len(logged) == 1 and "could not be sent" in logged[0] and "the client went away" in logged[0]


class HeldSink(Sink):
    """A client that takes no response until released."""

    def __init__(self):
        super().__init__()
        self.release = threading.Event()

    def send(self, response, final):
        self.release.wait(60)
        super().send(response, final)


def test_the_engine_runs_ahead_of_a_client_that_has_not_taken_its_responses(tiny_checkpoint):
    service = make_service(tiny_checkpoint)
    try:
        held, other = HeldSink(), Sink()
        service.submit(DecodeRequest(PROMPT, {"stream": True, "max_tokens": 12, "ignore_eos": True}), held)
        service.submit(DecodeRequest(PROMPT, {"stream": True, "max_tokens": 12, "ignore_eos": True}), other)
        wait_for(lambda: service.counts["requests_completed"] == 2)  # every token made, none sent to `held`
        assert held.responses == [] and not held.done.is_set()
        held.release.set()
        assert held.done.wait(60) and other.done.wait(60)
        assert [r.output_token_count for r in held.responses] == list(range(1, 13))
        assert [r.output_ids.tolist() for r in held.responses] == [r.output_ids.tolist() for r in other.responses]
    finally:
        service.shutdown()


def test_a_client_gone_mid_stream_is_stopped_without_counting_a_cancel(tiny_checkpoint):
    service = make_service(tiny_checkpoint)
    try:
        sink = FailingSink()
        service.submit(DecodeRequest(PROMPT, {"stream": True, "max_tokens": 240, "ignore_eos": True}), sink)
        assert sink.tried.wait(60)  # the engine runs it and a send failed
        blocks = service.engine.blocks
        wait_for(lambda: not service.engine.has_work and blocks.num_free == blocks.num_blocks)
        assert service.counts["requests_cancelled"] == 0 and service.counts["requests_completed"] == 0
    finally:
        service.shutdown()


def test_a_metrics_failure_does_not_cost_a_client_its_final_response(tiny_checkpoint):
    def broken(*_):
        raise RuntimeError("metrics endpoint gone")

    engine = LLMEngine(tiny_checkpoint, EngineConfig(device="cpu", num_kv_blocks=64, max_model_len=256,
                                                     max_num_batched_tokens=512))
    errors = []
    service = DecoderService(engine, TokenBytes.from_tokenizer_json(tiny_checkpoint), publish=broken, observe=broken,
                             log_error=errors.append)
    try:
        sink = Sink()
        service.submit(DecodeRequest(PROMPT, {"stream": True, "max_tokens": 4, "ignore_eos": True}), sink)
        assert sink.done.wait(60) and sink.finals == 1 and len(sink.responses) == 4
        assert errors and all("metrics endpoint gone" in e for e in errors)
    finally:
        service.shutdown()
