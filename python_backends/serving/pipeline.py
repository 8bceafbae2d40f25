"""mm_qa_bls's orchestration, without Triton: the mm_qa pipeline with what an ensemble cannot express.

`models/mm_qa_bls.py` turns each Triton request into a `QARequest` and a `ClientSink` and calls
`submit()`; the composed models are reached through `ModelCalls` (BLS in the adapter). At most
`max_waiting_requests` wait for a worker thread; more are refused busy (`ServerBusy`), and so are
the requests moe_decoder refuses busy. Per request, on a worker thread: preprocess -> each
image's features from the cache or, for the misses (batched with other requests' misses by
`VisionBatcher`), image_decode -> vision_encoder at keep ratio 1.0 -> VisionZip over all the
request's images under one budget, at the keep ratio the degradation level and the request's
priority give (`serving.load`) -> moe_decoder (streams, always) -> postprocess per response -> client
(each response, or one at the end when the client did not ask to stream).
The cache holds features *before* VisionZip, so a cached image serves any keep ratio; it
lives in host memory, so this path copies each missed image's features to the host once and the
kept tokens back to moe_decoder (mm_qa keeps them on the GPU all the way).

Cancellation: relaying stops (no more postprocess calls or sends), moe_decoder is told to stop the
request (`DecoderStream.cancel`: server 2.51's BLS cannot cancel a call, so the adapter sends a
control call naming the request's tag; the decoder aborts it before its next step and frees its KV
blocks), the decoder's remaining responses are read to the end (a decoupled BLS stream is freed only
then), and only then is the final flag sent (while the client's request is open the server
does not finalize the model; sent earlier, a shutdown right after a cancel hung, measured).
"""
from __future__ import annotations

import queue
import re
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Iterator, Protocol

import numpy as np
import torch

from ..embedding_cache import EmbeddingCache, content_key
from ..settings import setting
from ..visionzip import ImageFeatures, VisionZipConfig, compress, decoder_inputs
from .errors import SHUTTING_DOWN, BadInput, ModelError, ServerBusy, StreamLost, internal_error, server_busy
from .load import DEFAULT_PRIORITY, KeepChooser, check_priority

# moe_decoder outputs that go to the client as they are (text_output comes from postprocess).
RELAYED = ("input_token_count", "output_token_count", "finish_reason", "visual_tokens_kept", "visual_keep_ratio_used")
# stats() name -> (Prometheus metric, help), as the adapter publishes them.
METRICS = {
    "hits": ("zipmoe_bls_cache_hits_total", "Images whose vision features came from the cache"),
    "misses": ("zipmoe_bls_cache_misses_total", "Images sent to image_decode + vision_encoder"),
    "evictions": ("zipmoe_bls_cache_evictions_total", "Cached images evicted for space"),
    "bytes": ("zipmoe_bls_cache_bytes", "Bytes of vision features cached"),
    "rejected_busy": ("zipmoe_bls_requests_rejected_busy_total", "Requests refused busy: max_waiting_requests waiting"),
}
GAUGES = {"bytes"}
CACHE_STATS = ("hits", "misses", "evictions", "bytes")


@dataclass(frozen=True)
class PipelineConfig:
    """mm_qa_bls's settings (VisionZip's are read from vision_encoder/config.pbtxt: one source)."""
    max_images: int = setting(64, "images per request; more are refused before any work (<= image_decode's)", min=0)
    cache_bytes: int = setting(268435456, "bytes of vision features cached (LRU); 0 disables the cache", min=0)
    max_concurrent_requests: int = setting(64, "requests in progress at once (worker threads); more wait", min=1)
    max_waiting_requests: int = setting(256, "requests waiting for a worker thread; more are refused busy "
                                             "(0: no bound)", min=0)


@dataclass
class QARequest:
    question: str
    images: list[bytes]
    keep_ratio: float | None  # None: vision_encoder's keep_ratio
    decoder_inputs: dict  # the client's DECODER_OPTIONS, passed on to moe_decoder as they came
    priority: int = DEFAULT_PRIORITY


class DecoderStream(Protocol):
    # Each response's outputs by name; ModelError on an error; StreamLost when it ends before any response.
    def __iter__(self) -> Iterator[dict]: ...
    def cancel(self) -> None: ...  # ask moe_decoder to stop this request (its stream then ends soon)
    def drain(self) -> None: ...  # read whatever is left, to the end


class ModelCalls(Protocol):
    """The composed models (BLS calls in the adapter); tensors other than features are opaque here."""
    def tokenize(self, question: str, image_count: int) -> object: ...  # preprocess -> input_ids
    def encode_images(self, images: list[bytes]) -> list[ImageFeatures]: ...  # image_decode -> vision_encoder
    def decode(self, inputs: dict) -> DecoderStream: ...  # moe_decoder
    def detokenize(self, outputs: dict) -> bytes: ...  # postprocess: a response's window -> its text (UTF-8)
    def is_last(self, outputs: dict) -> bool: ...  # the decoder's response that ends the answer (a finish_reason)


class ClientSink(Protocol):
    def send(self, outputs: dict, final: bool = False) -> None: ...  # one response; final: the last one
    def close(self, error: str | None, busy: bool = False) -> None: ...  # the final flag, and the error if any
    def is_cancelled(self) -> bool: ...


def renumber_images(message: str, positions: list[int]) -> str:
    """image_decode and vision_encoder name an image by its index in the batch they got (the cache
    misses); the client needs its index in the request."""
    def fix(m: re.Match) -> str:
        i = int(m.group(1))
        return f"image {positions[i] if i < len(positions) else i}"
    return re.sub(r"\bimage (\d+)", fix, message)


def split_features(out: dict[str, torch.Tensor]) -> list[ImageFeatures]:
    """vision_encoder's outputs at keep ratio 1.0 -> one ImageFeatures per image.

    All rows of all images are back to back, image by image, in token order. Each image's rows are
    copied to the host, where the cache lives (cache_bytes of host memory: GPU memory is planned
    for the models, not for this process), so a cached image holds its own memory, not a view of
    the whole request's, which goes back to Triton."""
    counts = out["visual_tokens_kept"].reshape(-1).tolist()
    grids = [tuple(g) for g in out["image_grids"].reshape(-1, 2).tolist()]
    if counts != [rows * cols for rows, cols in grids]:
        raise RuntimeError(f"vision_encoder kept {counts} tokens of grids {grids}: not every token (keep 1.0?)")
    # One copy to the host per output (not one per image), then each image's rows cloned there.
    host = {name: out[name].cpu() for name in ("visual_embeds", "deepstack_embeds", "token_importance", "token_keys")}
    embeds, importance, keys = (host[n].split(counts) for n in ("visual_embeds", "token_importance", "token_keys"))
    deepstack = host["deepstack_embeds"].split(counts, dim=1)
    return [ImageFeatures(e.clone(), d.clone(), i.clone(), k.clone(), grid)
            for e, d, i, k, grid in zip(embeds, deepstack, importance, keys, grids)]


class VisionBatcher:
    """Gathers the cache misses of every request waiting and sends them through the vision tower in
    one call (at most `max_images`): concurrent requests share a vision forward. If a shared call
    fails (one request's image does not decode), each request is retried alone, so the error
    reaches only its owner."""

    def __init__(self, encode: Callable[[list[bytes]], list], max_images: int):
        self.encode = encode
        self.max_images = max_images
        self._queue: queue.Queue[tuple[list[bytes], Future]] = queue.Queue()
        threading.Thread(target=self._loop, name="mm_qa_bls-vision", daemon=True).start()

    def features(self, images: list[bytes]) -> list:
        done: Future = Future()
        self._queue.put((images, done))
        return done.result()

    def _loop(self):
        while True:
            batch = [self._queue.get()]
            count = len(batch[0][0])
            while True:  # take whatever else waits, as long as it fits
                try:
                    images, done = self._queue.get_nowait()
                except queue.Empty:
                    break
                if count + len(images) > self.max_images:
                    self._queue.put((images, done))  # next round (order among waiters does not matter)
                    break
                batch.append((images, done))
                count += len(images)
            self._run(batch)

    def _run(self, batch):
        try:
            features = self.encode([im for images, _ in batch for im in images])
        except Exception as e:
            if len(batch) == 1:
                batch[0][1].set_exception(e)
                return
            for job in batch:
                self._run([job])
            return
        start = 0
        for images, done in batch:
            done.set_result(features[start:start + len(images)])
            start += len(images)


UNANSWERED = "mm_qa_bls: moe_decoder ended the request without an answer"
LOST_STREAM_TRIES = 3  # decoder calls per request whose responses all went astray (StreamLost) before it fails


class QAPipeline:
    def __init__(self, calls: ModelCalls, config: PipelineConfig, visionzip: VisionZipConfig,
                 publish: Callable[[dict[str, int]], None] | None = None, log_error: Callable[[str], None] = print,
                 level: Callable[[], int] = lambda: 0):
        """publish(stats()) is called once each request's keep ratio is chosen (its cache lookups
        done) and after each refusal; level() reads moe_decoder's degradation level."""
        self.calls, self.config, self.visionzip = calls, config, visionzip
        self.keep = KeepChooser(visionzip.keep_ratio, visionzip.keep_ratio_min, level)
        self._publish, self._log_error = publish, log_error
        self.cache = EmbeddingCache(config.cache_bytes)
        self.vision = VisionBatcher(calls.encode_images, config.max_images)
        self._queued: dict[Future, ClientSink] = {}  # submitted and not yet finished
        # Requests submitted and not yet on a worker, what max_waiting_requests bounds (the pool's own
        # queue has no bound); counted on Triton's thread, discounted on the workers.
        self._waiting, self._waiting_lock, self.rejected_busy = 0, threading.Lock(), 0
        self.pool = ThreadPoolExecutor(config.max_concurrent_requests, thread_name_prefix="mm_qa_bls")

    def check(self, request: QARequest) -> None:
        """Refuses a bad request before any work (BadInput)."""
        if not request.question.strip():
            raise BadInput("text_input is empty: ask a question")
        if len(request.images) > self.config.max_images:
            raise BadInput(f"{len(request.images)} images; this deployment accepts at most {self.config.max_images}")
        for i, image in enumerate(request.images):
            if not image:
                raise BadInput(f"image {i}: empty")
        if request.keep_ratio is not None and not 0.0 < request.keep_ratio <= 1.0:
            raise BadInput(f"visual_keep_ratio must be in (0, 1], got {request.keep_ratio}")
        check_priority(request.priority)

    def submit(self, request: QARequest, sink: ClientSink) -> None:
        """Checks the request (BadInput, nothing started) and answers it on a worker thread; ServerBusy
        when max_waiting_requests wait for one already."""
        self.check(request)
        self._join_waiting()
        future = self.pool.submit(self._serve, request, sink)
        self._queued[future] = sink
        future.add_done_callback(lambda f: self._queued.pop(f, None) if not f.cancelled() else None)

    def _join_waiting(self) -> None:
        limit = self.config.max_waiting_requests
        with self._waiting_lock:
            waiting = self._waiting
            if not limit or waiting < limit:
                self._waiting += 1
                return
            self.rejected_busy += 1
        if self._publish is not None:
            self._publish(self.stats())
        raise server_busy(f"{waiting} requests waiting in mm_qa_bls (max_waiting_requests {limit})")

    def _serve(self, request: QARequest, sink: ClientSink) -> None:
        with self._waiting_lock:
            self._waiting -= 1
        error, busy, last = None, False, None
        try:
            last = self._answer(request, sink)
        except ServerBusy as e:  # moe_decoder's: passed on as it came
            error, busy = str(e), True
        except ModelError as e:
            error = str(e)
        except Exception as e:  # a bug must not leave the client waiting
            self._log_error(f"mm_qa_bls: request failed: {e!r}")
            error = internal_error("mm_qa_bls", e)
        if error is None and last is not None:
            sink.send(last, final=True)  # as mm_qa: no empty final response (perf_analyzer 2.51 mis-records one)
        else:
            sink.close(error, busy)

    def _answer(self, request: QARequest, sink: ClientSink) -> dict | None:
        """Relays the answer; returns its last response, for the caller to send with the final flag once
        the decoder's stream has ended (None: the client cancelled; ModelError(UNANSWERED): the decoder
        ended the stream without one, unasked)."""
        decoder_in = {"input_ids": self.calls.tokenize(request.question, len(request.images)), **request.decoder_inputs}
        features = self._features(request.images) if request.images else []
        # The level is read after the vision work: the latest moment before the decoder takes the request.
        ratio = self.keep.choose(request.keep_ratio, request.priority, len(request.images))
        if self._publish is not None:  # the cache's counts, and self.keep.degraded
            self._publish(self.stats())
        decoder_in["visual_keep_ratio_used"] = np.asarray([ratio], np.float32)
        if features:
            vz = self.visionzip
            decoder_in.update(decoder_inputs(compress(features, ratio, vz.context_fraction, vz.min_tokens_per_image)))
        if sink.is_cancelled():
            return None
        # moe_decoder always streams here: server 2.51's BLS call returns with its first response only,
        # so a non-streamed decode (one response, at the end) would hold this thread, deaf to a cancel
        # of its client, for the whole answer. A non-streamed answer is joined here from the deltas.
        streaming = bool(np.asarray(request.decoder_inputs.get("stream", False)).reshape(-1)[0])
        for attempt in range(1, LOST_STREAM_TRIES + 1):
            stream = self.calls.decode({**decoder_in, "stream": np.asarray([True])})
            try:
                last = self._relay(stream, sink, streaming)
                break
            except StreamLost as e:  # nothing reached the client: ask again
                stream.cancel()  # were it admitted after all, its tokens would go to no one
                self._log_error(f"mm_qa_bls: {e} (try {attempt} of {LOST_STREAM_TRIES})")
        else:
            raise ModelError(f"mm_qa_bls: moe_decoder's answer was lost on its way back {LOST_STREAM_TRIES} times")
        if last is None and not sink.is_cancelled():
            # moe_decoder stopped the request unasked: an empty final response would read as an answer
            # of nothing (HTTP generate: "expects exactly 1 response"), so say so, here and in the log.
            self._log_error(UNANSWERED)
            raise ModelError(UNANSWERED)
        return last

    def _relay(self, stream: DecoderStream, sink: ClientSink, streaming: bool) -> dict | None:
        """Sends each decoder response on (its text from postprocess; when not streaming, the texts
        joined into one at the end) and returns the last, unsent; None if the client cancelled or the
        decoder ended without one."""
        finished, last, texts = False, None, []
        try:
            for out in stream:
                if sink.is_cancelled():
                    stream.cancel()
                    return None
                texts.append(self.calls.detokenize(out))
                is_last = self.calls.is_last(out)
                if streaming or is_last:
                    response = {"text_output": np.asarray([b"".join(texts)], np.object_),
                                **{name: out[name] for name in RELAYED}}
                    texts = []
                    if is_last:
                        last = response
                    else:
                        sink.send(response)
            finished = True
        finally:
            if not finished:  # cancelled, or an error: see the module docstring
                stream.drain()
        return last

    def _features(self, images: list[bytes]) -> list[ImageFeatures]:
        """Each image's features: from the cache, or (the misses, once each, in one call) from the vision tower."""
        keys = [content_key(image) for image in images]
        position = {}  # key -> index of its first image in the request
        for i, key in enumerate(keys):
            position.setdefault(key, i)
        found = {key: self.cache.get(key) for key in position}
        missing = [key for key, value in found.items() if value is None]
        if missing:
            try:
                computed = self.vision.features([images[position[k]] for k in missing])
            except ModelError as e:
                raise ModelError(renumber_images(str(e), [position[k] for k in missing])) from None
            for key, value in zip(missing, computed):
                self.cache.put(key, value)
                found[key] = value
        return [found[key] for key in keys]

    def stats(self) -> dict[str, int]:
        return {**{name: getattr(self.cache, name) for name in CACHE_STATS}, "rejected_busy": self.rejected_busy}

    def shutdown(self, message: str = SHUTTING_DOWN) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
        # Requests still queued were cancelled above: each still needs its final response, or the
        # server's shutdown waits for it.
        for future, sink in list(self._queued.items()):
            if future.cancelled():
                sink.close(message)

