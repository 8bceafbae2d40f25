"""serving.decoder.DecoderService driven directly (no Triton): admission, streaming windows, stop
strings, cancellation mid-stream, refused requests, overload (the bounded wait), its metrics and the
degradation level it derives from the load."""
from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from zipmoe.detokenize import TokenBytes, window_text
from zipmoe.engine.engine import EngineConfig, LLMEngine, RequestError
from zipmoe.serving.decode_request import DecodeRequest, VisualTokens
from zipmoe.serving.decoder import DecoderConfig, DecoderService
from zipmoe.serving.decoder_metrics import COUNTERS, GAUGES, HISTOGRAMS
from zipmoe.serving.errors import BadInput, ServerBusy
from zipmoe.serving.load import UP_PRESSURE, DegradationConfig

PROMPT = [5, 17, 42, 99, 7, 3]


class Sink:
    def __init__(self, cancel_after: int | None = None):
        self.responses, self.errors, self.finals, self.busy = [], [], 0, False
        self.cancel_after = cancel_after
        self.done = threading.Event()

    def send(self, response, final):
        if response is not None:
            self.responses.append(response)
        if final:
            self.finals += 1
            self.done.set()

    def send_error(self, message, busy=False):
        self.errors.append(message)
        self.busy = busy
        self.done.set()

    def is_cancelled(self):
        return self.cancel_after is not None and len(self.responses) >= self.cancel_after

    def text(self, token_bytes) -> str:
        return "".join(window_text(token_bytes, r.output_ids.tolist(), *r.text_range) for r in self.responses)


def make_service(checkpoint, max_num_seqs: int = 64, degradation=DegradationConfig(), on_level=None,
                 **config) -> DecoderService:
    engine = LLMEngine(checkpoint, EngineConfig(device="cpu", num_kv_blocks=64, max_model_len=256,
                                                max_num_batched_tokens=512, max_num_seqs=max_num_seqs))
    published, observed = [], []
    svc = DecoderService(engine, TokenBytes.from_tokenizer_json(checkpoint), DecoderConfig(**config),
                         publish=published.append, observe=lambda name, value: observed.append((name, value)),
                         degradation=degradation, on_level=on_level)
    svc.published, svc.observed = published, observed
    return svc


@pytest.fixture()
def service(tiny_checkpoint):
    svc = make_service(tiny_checkpoint, default_max_tokens=5)
    yield svc
    svc.shutdown()


@pytest.fixture()
def one_seat(tiny_checkpoint):
    """A service that runs one sequence at a time, so that the next ones wait; `holder` occupies it."""
    def start(**config):
        svc = make_service(tiny_checkpoint, max_num_seqs=1, **config)
        holder = Sink()
        svc.submit(DecodeRequest(PROMPT, {"stream": True, "max_tokens": 240, "ignore_eos": True}, tag="holder"), holder)
        deadline = time.monotonic() + 60
        while not holder.responses:  # admitted: it no longer counts as waiting
            assert time.monotonic() < deadline and not holder.done.wait(0.01)
        services.append(svc)
        return svc, holder

    services = []
    yield start
    for svc in services:
        svc.shutdown()


def run(service, options, ids=PROMPT, visual=None, sink=None):
    sink = sink or Sink()
    service.submit(DecodeRequest(list(ids), options, visual), sink)
    assert sink.done.wait(60)
    return sink


def test_streams_one_window_per_token_and_the_text_adds_up(service):
    tb = service.token_bytes
    streamed = run(service, {"stream": True, "max_tokens": 12, "ignore_eos": True})
    whole = run(service, {"max_tokens": 12, "ignore_eos": True})
    assert len(streamed.responses) == 12 and streamed.finals == 1 and len(whole.responses) == 1
    last = streamed.responses[-1]
    assert (last.output_token_count, last.finish_reason, last.input_token_count) == (12, "length", len(PROMPT))
    assert [r.finish_reason for r in streamed.responses[:-1]] == [""] * 11
    assert streamed.text(tb) == whole.text(tb)
    assert whole.responses[0].output_ids.dtype == np.int32


def test_default_max_tokens_comes_from_the_service_config(service):
    assert run(service, {"ignore_eos": True}).responses[-1].output_token_count == 5


def test_stop_string_ends_the_answer_before_it(service):
    tb = service.token_bytes
    full = run(service, {"max_tokens": 16, "ignore_eos": True}).text(tb)
    stop = full[len(full) // 2:len(full) // 2 + 2]
    if not stop.strip():
        pytest.skip("the tiny model's answer has no printable middle")
    cut = run(service, {"max_tokens": 16, "ignore_eos": True, "stop_words": [stop.encode()], "stream": True})
    assert cut.responses[-1].finish_reason == "stop"
    assert cut.text(tb) == full[:full.index(stop)]


def test_cancel_mid_stream_frees_blocks_and_counts(service):
    sink = run(service, {"stream": True, "max_tokens": 200, "ignore_eos": True}, sink=Sink(cancel_after=2))
    assert 2 <= len(sink.responses) < 200 and sink.finals == 1 and not sink.errors
    blocks = service.engine.blocks
    assert blocks.num_free == blocks.num_blocks
    assert service.counts["requests_cancelled"] == 1


@pytest.mark.parametrize("options, error, message", [
    ({"max_tokens": 0}, RequestError, "max_tokens"),
    ({"temperature": -1.0}, RequestError, "temperature"),
    ({"top_p": 1.5}, RequestError, "top_p"),
])
def test_bad_requests_are_refused_at_submit(service, options, error, message):
    with pytest.raises(error, match=message):
        service.submit(DecodeRequest(PROMPT, options), Sink())
    assert not service.engine.has_work


def test_visual_tokens_that_disagree_are_refused(service):
    width = service.engine.text.hidden_size
    image = service.engine.text.image_token_id
    visual = VisualTokens(torch.zeros(3, width), torch.zeros(1, 3, width), torch.zeros(3, 2, dtype=torch.int32),
                          torch.tensor([[2, 2]], dtype=torch.int32), torch.tensor([4], dtype=torch.int32))
    with pytest.raises(BadInput, match=r"visual_embeds must have shape \[4, "):
        service.submit(DecodeRequest([1, image, 2], {}, visual), Sink())


def test_stats_cover_every_published_metric(service):
    run(service, {"max_tokens": 3, "ignore_eos": True})
    stats = service.published[-1]
    assert set(stats) == set(COUNTERS) | set(GAUGES)
    assert stats["requests_completed"] == 1 and stats["decode_tokens"] == 2
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"] == 64 and stats["kv_capacity_tokens"] == 64 * 16
    # A prefill, a decode step read back, one launched behind it (async scheduling, the default).
    assert (stats["engine_steps"], stats["engine_steps_pipelined"]) == (3, 1)


def test_shutdown_answers_whoever_waits(tiny_checkpoint):
    engine = LLMEngine(tiny_checkpoint, EngineConfig(device="cpu", num_kv_blocks=64, max_model_len=256,
                                                     max_num_batched_tokens=512))
    svc = DecoderService(engine, TokenBytes.from_tokenizer_json(tiny_checkpoint))
    sink = Sink()
    svc.submit(DecodeRequest(PROMPT, {"max_tokens": 200, "ignore_eos": True, "stream": True}), sink)
    svc.shutdown()
    assert sink.done.is_set()
    assert sink.errors == ["the server is shutting down"] or sink.finals == 1


def test_each_finished_request_is_observed_once_per_histogram(service):
    run(service, {"max_tokens": 4, "ignore_eos": True, "stream": True})
    run(service, {"max_tokens": 1, "ignore_eos": True})  # one token: no gap between tokens to observe
    names = [name for name, _ in service.observed]
    assert sorted(names) == ["itl_s", "ttft_s", "ttft_s"]
    assert set(names) == set(HISTOGRAMS) - {"keep_ratio"}  # observed for requests with images only
    assert all(value > 0 for _, value in service.observed)


def test_visual_tokens_before_and_after_visionzip_are_counted_and_the_keep_ratio_echoed(service):
    text = service.engine.text
    width, layers = text.hidden_size, text.deepstack_layers
    kept, grid = 3, (2, 4)  # 3 of an image's 8 merged tokens
    visual = VisualTokens(torch.zeros(kept, width), torch.zeros(layers, kept, width),
                          torch.tensor([[0, 0], [0, 3], [1, 2]], dtype=torch.int32),
                          torch.tensor([grid], dtype=torch.int32), torch.tensor([kept], dtype=torch.int32))
    sink = Sink()
    service.submit(DecodeRequest([1, text.image_token_id, 2], {"max_tokens": 2, "ignore_eos": True, "stream": True},
                                 visual, keep_ratio=0.375), sink)
    assert sink.done.wait(60)
    assert [r.visual_keep_ratio_used for r in sink.responses] == [0.375, 0.375]  # in every response
    text_only = run(service, {"max_tokens": 2, "ignore_eos": True})  # counts nothing
    assert text_only.responses[-1].visual_keep_ratio_used == 1.0  # no VisionZip before it
    stats = service.published[-1]
    assert (stats["visual_tokens"], stats["visual_tokens_kept"]) == (8, 3)
    assert [value for name, value in service.observed if name == "keep_ratio"] == [0.375]


def test_the_degradation_level_follows_the_load_and_is_published(tiny_checkpoint):
    """A target of 1 ms: any request's TTFT is pressure; the level rises a step after UP_AFTER_S of it,
    reaches on_level and the metrics, and (the TTFT window emptied) falls again."""
    levels = []
    svc = make_service(tiny_checkpoint, degradation=DegradationConfig(ttft_target_ms=1),
                       on_level=lambda level, why: levels.append((level, why)))
    try:
        run(svc, {"max_tokens": 2, "ignore_eos": True})
        deadline = time.monotonic() + 30
        while not levels and time.monotonic() < deadline:
            time.sleep(0.05)
        level, why = levels[0]
        assert level == 1 and "TTFT" in why and " / 1 ms" in why
        stats = svc.stats()
        assert stats["degradation_level"] >= 1 and stats["load_pressure"] >= UP_PRESSURE
        assert any(p["degradation_level"] >= 1 for p in svc.published)
    finally:
        svc.shutdown()


def test_no_level_without_a_ttft_target(tiny_checkpoint):
    levels = []
    svc = make_service(tiny_checkpoint, max_num_seqs=1, degradation=DegradationConfig(ttft_target_ms=0),
                       on_level=lambda level, why: levels.append(level))
    try:
        sinks = [Sink() for _ in range(4)]  # three wait behind the one seat: pressure 3 if it were on
        for sink in sinks:
            svc.submit(DecodeRequest(PROMPT, {"max_tokens": 40, "ignore_eos": True}), sink)
        assert all(sink.done.wait(60) for sink in sinks)
        assert not levels and (svc.stats()["degradation_level"], svc.stats()["load_pressure"]) == (0, 0.0)
    finally:
        svc.shutdown()


def test_cancel_by_tag_stops_that_request_only(service):
    """mm_qa_bls's way to cancel: a control call naming the tag the request was submitted with."""
    tagged, other = Sink(), Sink()
    service.submit(DecodeRequest(PROMPT, {"stream": True, "max_tokens": 200, "ignore_eos": True}, tag="abc"), tagged)
    service.submit(DecodeRequest(PROMPT, {"max_tokens": 20, "ignore_eos": True}, tag="xyz"), other)
    service.cancel("abc")
    service.cancel("never-seen")  # ignored
    assert tagged.done.wait(60) and other.done.wait(60)
    assert tagged.finals == 1 and len(tagged.responses) < 200 and not tagged.errors
    assert other.responses[-1].output_token_count == 20
    assert service.counts["requests_cancelled"] == 1
    assert service.engine.blocks.num_free == service.engine.blocks.num_blocks


def test_requests_beyond_max_waiting_are_refused_busy_and_the_waiting_ones_answered(one_seat):
    service, holder = one_seat(max_waiting_requests=2)
    waiting = [Sink(), Sink()]
    for sink in waiting:
        service.submit(DecodeRequest(PROMPT, {"max_tokens": 3, "ignore_eos": True}), sink)
    with pytest.raises(ServerBusy, match=r"^server busy: 2 requests waiting in moe_decoder "
                                         r"\(max_waiting_requests 2\); retry later$"):
        service.submit(DecodeRequest(PROMPT, {"max_tokens": 3}), Sink())
    with pytest.raises(RequestError, match="max_tokens"):  # a bad request is still told what is wrong with it
        service.submit(DecodeRequest(PROMPT, {"max_tokens": 0}), Sink())
    service.cancel("holder")
    assert all(sink.done.wait(60) for sink in waiting)
    assert [sink.responses[-1].output_token_count for sink in waiting] == [3, 3]
    assert run(service, {"max_tokens": 2, "ignore_eos": True}).responses[-1].output_token_count == 2  # room again
    assert service.published[-1]["requests_rejected_busy"] == 1


def test_the_bound_holds_when_many_threads_submit_at_once(one_seat):
    service, holder = one_seat(max_waiting_requests=3)

    def submit(_):
        try:
            service.submit(DecodeRequest(PROMPT, {"max_tokens": 2}), Sink())
            return "queued"
        except ServerBusy:
            return "busy"

    with ThreadPoolExecutor(16) as pool:
        outcomes = list(pool.map(submit, range(16)))
    assert outcomes.count("queued") == 3 and service.counts["requests_rejected_busy"] == 13


def test_a_request_not_admitted_within_the_queue_delay_is_refused_busy(one_seat):
    service, holder = one_seat(max_queue_delay_ms=50)
    late = Sink()
    service.submit(DecodeRequest(PROMPT, {"stream": True, "max_tokens": 3}), late)
    assert late.done.wait(10)
    assert late.busy and not late.responses and late.errors == [
        "server busy: not admitted within max_queue_delay_ms 50 in moe_decoder; retry later"]
    assert not holder.done.is_set()  # the running request goes on
    assert len(service.engine.scheduler.waiting) == 0 and service.counts["requests_rejected_busy"] == 1
    service.cancel("holder")
    assert holder.done.wait(60) and holder.finals == 1


def test_periodic_publishes_follow_the_tokens_and_the_last_one_precedes_the_end(tiny_checkpoint, monkeypatch):
    """A periodic publish comes after the step's tokens are handed to the response writer (it never
    holds them back), and the publish of a request's end before its last response (its client then
    finds it in the metrics)."""
    from zipmoe.serving import decoder
    monkeypatch.setattr(decoder, "METRICS_PERIOD_S", 0.0)  # every step publishes
    svc = make_service(tiny_checkpoint)
    sink, handed, seen = Sink(), [], []  # seen: (responses handed over, requests completed) at each publish
    send = svc._send
    svc._send = lambda *args: handed.append(args) or send(*args)
    svc._publish = lambda stats: seen.append((len(handed), stats["requests_completed"]))
    try:
        svc.submit(DecodeRequest(PROMPT, {"stream": True, "max_tokens": 5, "ignore_eos": True}), sink)
        assert sink.done.wait(60) and len(sink.responses) == 5
    finally:
        svc.shutdown()
    ends = [n for n, completed in seen if completed == 1]
    assert ends[0] == 4  # published before the last response was handed over
    assert {1, 2, 3, 4} <= {n for n, completed in seen if completed == 0}  # each after its step's token


def test_a_request_that_ends_holds_back_no_other_requests_token(tiny_checkpoint, monkeypatch):
    """In the step where one request ends, the tokens of those going on are handed over before the
    end is counted and published (a publish is IPC, and a read of the routing sums used to wait for
    the step in flight); the ending request's last response still follows the publish."""
    from zipmoe.serving import decoder
    monkeypatch.setattr(decoder, "METRICS_PERIOD_S", 3600.0)  # only a request's end publishes
    svc = make_service(tiny_checkpoint)
    short, long_ = Sink(), Sink()
    events, steps = [], []  # ("send", sink, final) and ("publish", requests completed); the step of each
    send, emit = svc._send, svc._emit
    svc._send = lambda p, response, final: events.append(("send", p.sink, final)) or send(p, response, final)
    svc._publish = lambda stats: events.append(("publish", stats["requests_completed"]))
    svc._emit = lambda results: steps.append(len(events)) or emit(results)
    try:
        svc.submit(DecodeRequest(PROMPT, {"stream": True, "max_tokens": 200, "ignore_eos": True}), long_)
        deadline = time.monotonic() + 60
        while not long_.responses and time.monotonic() < deadline:
            time.sleep(0.01)
        svc.submit(DecodeRequest(PROMPT, {"stream": True, "max_tokens": 3, "ignore_eos": True}), short)
        assert short.done.wait(60)
    finally:
        svc.shutdown()
    end = events.index(("publish", 1))
    first = max(s for s in steps if s <= end)  # the events of the step that ended the short request
    step = events[first:next((s for s in steps if s > end), len(events))]
    assert ("send", long_, False) in step[:step.index(("publish", 1))]  # the other stream's token went first
    assert step[step.index(("publish", 1)) + 1:] == [("send", short, True)]  # then only the ending request's
