"""serving.pipeline (mm_qa_bls's orchestration) driven directly, its models faked: relaying, the
feature cache, shared vision batches, cancellation mid-stream, errors, validation and overload."""
from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from zipmoe.models.io import Metrics, SyncedMetric
from zipmoe.serving.errors import BadInput, ModelError, ServerBusy, StreamLost
from zipmoe.serving.load import DEFAULT_PRIORITY, MAX_LEVEL
from zipmoe.serving.pipeline import (LOST_STREAM_TRIES, METRICS, UNANSWERED, PipelineConfig, QAPipeline, QARequest,
                                     VisionBatcher, renumber_images)
from zipmoe.visionzip import ImageFeatures, VisionZipConfig

WIDTH = 8


def features(image: bytes) -> ImageFeatures:
    """A 2x4 grid of tokens whose values depend on the image's bytes."""
    g = torch.Generator().manual_seed(sum(image))
    return ImageFeatures(torch.randn(8, WIDTH, generator=g), torch.randn(2, 8, WIDTH, generator=g),
                         torch.rand(8, generator=g), torch.randn(8, 4, generator=g), (2, 4))


class Stream:
    def __init__(self, n: int, fail_at: int | None, lost: bool = False):
        self.n, self.fail_at, self.read, self.drained, self.cancelled_at = n, fail_at, 0, False, None
        self.lost = lost  # ends before its first response, as a stream whose responses went astray

    def _next(self):
        while self.read < self.n:
            self.read += 1
            yield self.read - 1

    def __iter__(self):
        if self.lost:
            raise StreamLost("moe_decoder's stream ended before its first response")
        for i in self._next():
            if i == self.fail_at:
                raise ModelError("moe_decoder: boom")
            yield {"output_ids": [i], "text_range": [0, 1], "input_token_count": 3, "output_token_count": i + 1,
                   "finish_reason": "length" if i == self.n - 1 else "", "visual_tokens_kept": [],
                   "visual_keep_ratio_used": [0.5]}

    def cancel(self):
        self.cancelled_at = self.read

    def drain(self):
        for _ in self._next():
            pass
        self.drained = True


class Calls:
    def __init__(self, responses: int = 4, fail_at: int | None = None, bad_image: bytes | None = None,
                 gate: threading.Event | None = None, busy: str | None = None, lost: int = 0):
        self.responses, self.fail_at, self.bad_image = responses, fail_at, bad_image
        self.gate, self.busy = gate, busy  # decode waits for the gate; answers busy
        self.lost = lost  # the first `lost` decoder streams end before their first response
        self.encoded, self.decoded, self.streams = [], [], []

    def tokenize(self, question, image_count):
        return np.arange(3 + image_count, dtype=np.int32)

    def encode_images(self, images):
        self.encoded.append(list(images))
        if self.bad_image in images:
            raise ModelError(f"image_decode: image {images.index(self.bad_image)}: cannot decode")
        return [features(im) for im in images]

    def decode(self, inputs):
        self.decoded.append(inputs)
        if self.gate is not None:
            assert self.gate.wait(10)
        if self.busy is not None:
            raise ServerBusy(self.busy)
        lost = len(self.streams) < self.lost
        self.streams.append(Stream(0 if lost else self.responses, self.fail_at, lost))
        return self.streams[-1]

    def detokenize(self, outputs):
        return f"t{outputs['output_ids'][0]}".encode()

    def is_last(self, outputs):
        return bool(outputs["finish_reason"])


class Sink:
    def __init__(self, cancel_after: int | None = None):
        self.sent, self.error, self.busy, self.cancel_after = [], None, False, cancel_after
        self.closed = threading.Event()
        self.drained_before_close = None
        self.final_with_last = False

    def send(self, outputs, final=False):
        assert not self.closed.is_set(), "a response after the final one"
        self.sent.append(outputs)
        if final:
            self.final_with_last = True
            self.closed.set()

    def close(self, error, busy=False):
        self.error, self.busy = error, busy
        self.closed.set()

    def is_cancelled(self):
        return self.cancel_after is not None and len(self.sent) >= self.cancel_after


def pipeline(calls, published=None, level=lambda: 0, **config) -> QAPipeline:
    return QAPipeline(calls, PipelineConfig(**config), VisionZipConfig(keep_ratio=0.5, keep_ratio_min=0.1,
                                                                      context_fraction=0.0, min_tokens_per_image=1),
                      publish=None if published is None else published.append, level=level)


def ask(p: QAPipeline, sink=None, images=(), keep_ratio=None, priority=DEFAULT_PRIORITY, **options) -> Sink:
    sink = sink or Sink()
    p.submit(QARequest("what is it?", list(images), keep_ratio, options, priority), sink)
    assert sink.closed.wait(10)
    return sink


def texts(sink: Sink) -> list[str]:
    return [s["text_output"].item().decode() for s in sink.sent]


def test_relays_every_decoder_response_with_its_text_then_closes():
    calls = Calls(responses=3)
    sink = ask(pipeline(calls), images=[b"a", b"b"], max_tokens=np.array([7], np.int32), stream=np.array([True]))
    assert texts(sink) == ["t0", "t1", "t2"] and sink.error is None
    assert sink.sent[-1]["finish_reason"] == "length" and sink.final_with_last  # no empty final response
    inputs = calls.decoded[0]
    assert inputs["max_tokens"].tolist() == [7] and inputs["input_ids"].tolist() == [0, 1, 2, 3, 4]
    assert inputs["visual_tokens_kept"].sum() == 8  # keep 0.5 of 2 x 8 tokens, one budget for both
    assert inputs["visual_embeds"].shape == (8, WIDTH) and inputs["deepstack_embeds"].shape == (2, 8, WIDTH)
    full = ask(pipeline(Calls()), images=[b"a", b"b"], keep_ratio=1.0)
    assert full.sent[-1]["visual_tokens_kept"] == []  # relayed from the decoder as it came


def test_a_decoder_stream_that_ends_without_an_answer_is_an_error_and_logged():
    logged = []
    p = QAPipeline(Calls(responses=0), PipelineConfig(), VisionZipConfig(), log_error=logged.append)
    sink = ask(p)
    assert sink.sent == [] and sink.error == UNANSWERED and logged == [UNANSWERED]


def test_a_lost_decoder_stream_is_cancelled_and_asked_again_then_an_error_and_logged():
    """A stream that ends before its first response (its responses went astray in the stub) reached
    the client with nothing: the decoder is told to stop it and asked again, LOST_STREAM_TRIES times."""
    logged = []
    calls = Calls(responses=2, lost=LOST_STREAM_TRIES - 1)
    sink = ask(QAPipeline(calls, PipelineConfig(), VisionZipConfig(), log_error=logged.append), stream=np.array([True]))
    assert texts(sink) == ["t0", "t1"] and sink.error is None and sink.final_with_last
    assert len(calls.decoded) == LOST_STREAM_TRIES and [s.cancelled_at for s in calls.streams] == [0, 0, None]
    assert len(logged) == LOST_STREAM_TRIES - 1 and all("before its first response" in m for m in logged)
    calls = Calls(lost=LOST_STREAM_TRIES)
    sink = ask(QAPipeline(calls, PipelineConfig(), VisionZipConfig(), log_error=logged.append))
    assert sink.sent == [] and f"lost on its way back {LOST_STREAM_TRIES} times" in sink.error
    assert len(calls.decoded) == LOST_STREAM_TRIES
    assert all(s.cancelled_at == 0 for s in calls.streams)


def test_the_keep_ratio_follows_the_level_and_the_priority():
    """keep_ratio 0.5, keep_ratio_min 0.1, 2 images x 8 tokens: at level 3 priority 1 goes 2 of 4 steps
    down (0.3: 5 tokens), priority 2 three (0.2: 3 tokens), priority 0 none (0.5: 8 tokens)."""
    calls, level, published = Calls(), [3], []
    p = pipeline(calls, published, level=lambda: level[0])
    for priority in (0, 1, 2):
        ask(p, images=[b"a", b"b"], priority=priority)
    sent = [(round(float(d["visual_keep_ratio_used"][0]), 3), int(d["visual_tokens_kept"].sum())) for d in calls.decoded]
    assert sent == [(0.5, 8), (0.3, 5), (0.2, 3)]
    ask(p, images=[b"a"], keep_ratio=0.9, priority=1)  # its own ratio is its base: 0.9 - 2/4 of (0.9 - 0.1)
    assert float(calls.decoded[-1]["visual_keep_ratio_used"][0]) == pytest.approx(0.5)
    level[0] = MAX_LEVEL
    ask(p, priority=2)  # text only: reported, not counted as degraded
    assert float(calls.decoded[-1]["visual_keep_ratio_used"][0]) == pytest.approx(0.1)
    assert p.keep.degraded == {1: 2, 2: 1}
    assert ask(p, images=[b"a"]).sent[-1]["visual_keep_ratio_used"] == [0.5]  # relayed from the decoder


def test_repeated_images_come_from_the_cache_once_each():
    calls, published = Calls(), []
    p = pipeline(calls, published)
    ask(p, images=[b"a", b"b", b"a"])
    ask(p, images=[b"b", b"c"])
    assert calls.encoded == [[b"a", b"b"], [b"c"]]
    assert published[-1]["hits"] == 1 and published[-1]["misses"] == 3 and set(published[-1]) == set(METRICS)


def test_cancel_mid_stream_stops_relaying_reads_the_decoder_to_its_end_then_closes():
    calls = Calls(responses=50)
    sink = ask(pipeline(calls), sink=Sink(cancel_after=1), stream=np.array([True]))
    assert len(sink.sent) == 1 and sink.error is None
    assert calls.streams[0].cancelled_at == 2  # told to stop when the second response found the client gone
    assert calls.streams[0].drained and calls.streams[0].read == 50


class GoneAfterLooks(Sink):
    """A client that is gone from its `looks`-th is_cancelled() on."""

    def __init__(self, looks: int):
        super().__init__()
        self.looks, self.looked = looks, 0

    def is_cancelled(self):
        self.looked += 1
        return self.looked >= self.looks


def test_a_non_streamed_answer_is_decoded_as_a_stream_joined_and_cancellable_midway():
    calls = Calls(responses=3)
    sink = ask(pipeline(calls), stream=np.array([False]))
    assert texts(sink) == ["t0t1t2"] and sink.final_with_last and sink.sent[0]["output_token_count"] == 3
    assert calls.decoded[0]["stream"].tolist() == [True]  # a BLS call returns with its first response only
    calls = Calls(responses=50)
    sink = ask(pipeline(calls), sink=GoneAfterLooks(looks=5))  # one look before decoding, then one a response
    assert sink.sent == [] and sink.error is None
    assert calls.streams[0].cancelled_at == 4 and calls.streams[0].drained


def test_decoder_error_reaches_the_client_after_the_stream_is_drained():
    calls = Calls(responses=6, fail_at=2)
    sink = ask(pipeline(calls), stream=np.array([True]))
    assert len(sink.sent) == 2 and sink.error == "moe_decoder: boom"
    assert calls.streams[0].drained and calls.streams[0].read == 6


def test_an_image_error_names_the_image_by_its_place_in_the_request():
    calls = Calls(bad_image=b"bad")
    p = pipeline(calls)
    ask(p, images=[b"a"])
    sink = ask(p, images=[b"a", b"bad"])  # a is cached: the miss batch is [bad], index 0 there
    assert sink.error == "image_decode: image 1: cannot decode" and not calls.decoded[1:]
    assert renumber_images("image 0 and image 1", [3, 5]) == "image 3 and image 5"


@pytest.mark.parametrize("request_, message", [
    (QARequest(" ", [], None, {}), "text_input is empty"),
    (QARequest("q", [b"x"] * 3, None, {}), "3 images; this deployment accepts at most 2"),
    (QARequest("q", [b"x", b""], None, {}), "image 1: empty"),
    (QARequest("q", [], 0.0, {}), r"visual_keep_ratio must be in \(0, 1\]"),
    (QARequest("q", [], None, {}, 3), "priority must be 0 .never degraded. to 2"),
    (QARequest("q", [], None, {}, -1), "priority must be 0"),
])
def test_bad_requests_are_refused_before_any_work(request_, message):
    calls = Calls()
    with pytest.raises(BadInput, match=message):
        pipeline(calls, max_images=2).submit(request_, Sink())
    assert not calls.encoded and not calls.decoded


def test_waiting_requests_share_one_vision_call_and_errors_stay_with_their_owner():
    calls, first_started, release = [], threading.Event(), threading.Event()

    def encode(images):
        calls.append(list(images))
        if len(calls) == 1:  # hold the first call until the others are queued behind it
            first_started.set()
            release.wait(5)
        if b"bad" in images:
            raise ModelError("image_decode: image 0: cannot decode")
        return [f"features of {im.decode()}" for im in images]

    batcher = VisionBatcher(encode, max_images=8)
    with ThreadPoolExecutor(4) as pool:
        first = pool.submit(batcher.features, [b"a"])
        first_started.wait(5)
        rest = [pool.submit(batcher.features, imgs) for imgs in ([b"b", b"c"], [b"bad"], [b"d"])]
        deadline = time.monotonic() + 5
        while batcher._queue.qsize() < 3 and time.monotonic() < deadline:
            time.sleep(0.001)
        release.set()
        assert first.result(5) == ["features of a"]
        assert rest[0].result(5) == ["features of b", "features of c"]
        with pytest.raises(ModelError, match="cannot decode"):
            rest[1].result(5)
        assert rest[2].result(5) == ["features of d"]
    assert calls[1] == [b"b", b"c", b"bad", b"d"]  # the three waiting requests went as one call
    assert [b"bad"] in calls[2:] and [b"d"] in calls[2:]  # then, after it failed, one by one


def test_requests_beyond_max_waiting_are_refused_busy_and_the_others_answered():
    gate, published = threading.Event(), []
    calls = Calls(gate=gate)
    p = pipeline(calls, published, max_concurrent_requests=1, max_waiting_requests=1)
    running, waiting = Sink(), Sink()
    p.submit(QARequest("q", [], None, {}), running)
    deadline = time.monotonic() + 5
    while not calls.decoded:  # on the only worker, held at the decoder
        assert time.monotonic() < deadline
        time.sleep(0.001)
    p.submit(QARequest("q", [], None, {}), waiting)
    with pytest.raises(ServerBusy, match=r"^server busy: 1 requests waiting in mm_qa_bls "
                                         r"\(max_waiting_requests 1\); retry later$"):
        p.submit(QARequest("q", [], None, {}), Sink())
    assert published[-1]["rejected_busy"] == 1
    gate.set()
    for sink in (running, waiting):
        assert sink.closed.wait(10) and sink.error is None and texts(sink) == ["t0t1t2t3"]
    assert ask(p).error is None  # room again


def test_a_busy_decoder_is_passed_on_as_busy():
    message = "server busy: 2 requests waiting in moe_decoder (max_waiting_requests 2); retry later"
    sink = ask(pipeline(Calls(busy=message)))
    assert (sink.error, sink.busy, sink.sent) == (message, True, [])


def test_a_counter_value_read_before_another_thread_s_larger_one_is_not_sent():
    """Workers and Triton's thread both publish stats(): a stale, smaller value must not shrink a counter."""
    sent = []
    counter = SyncedMetric(type("Metric", (), {"increment": lambda self, n: sent.append(n)})(), counter=True)
    for value in (2, 5, 3, 5, 7):
        counter.sync(value)
    assert sent == [2, 3, 2]


class FakeFamily:
    COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"
    alive = 0

    def __init__(self, name, description, kind):
        FakeFamily.alive += 1

    def __del__(self):
        FakeFamily.alive -= 1

    def Metric(self, labels, buckets=None):
        return type("Metric", (), {"increment": lambda s, n: SENT.append(n), "set": lambda s, v: SENT.append(v),
                                   "observe": lambda s, v: SENT.append(v), "family": self})()


SENT = []


def test_closing_the_metrics_drops_every_family_before_the_stub_exits():
    """A model's finalize closes its metrics: no family outlives it (server 2.51's stub crashed
    clearing one from its destructor), and a late publish from a thread still running sends nothing."""
    pb = type("pb", (), {"MetricFamily": FakeFamily})
    metrics = Metrics(pb, "m")
    counter, gauge = metrics.counter("c", ""), metrics.gauge("g", "")
    histogram, labelled = metrics.histogram("h", "", [1.0]), metrics.labelled_counters("l", "", "p", ["a", "b"])
    counter.sync(3), gauge.sync(2), histogram.observe(0.5), labelled["a"].sync(1)
    assert SENT == [3, 2, 0.5, 1] and FakeFamily.alive == 4
    metrics.close()
    assert FakeFamily.alive == 0  # the model still holds its metrics, but not their families
    counter.sync(5), gauge.sync(4), histogram.observe(0.7), labelled["b"].sync(1)
    assert SENT == [3, 2, 0.5, 1]
