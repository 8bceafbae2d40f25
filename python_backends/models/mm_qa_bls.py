"""`mm_qa_bls`: the mm_qa pipeline composed through BLS, with logic an ensemble cannot express.

Same client interface and answers as the mm_qa ensemble; in addition: requests are validated before
any work, and each image's vision features are cached by content hash, so an image seen before
skips decoding and the vision tower. The cache holds features *before* VisionZip (vision_encoder
runs at keep ratio 1.0 and also returns every token's importance and key); VisionZip then runs here
over all images of the request, cached or not, under the request's one token budget.

Per request, on a worker thread (execute() returns at once, so streams run concurrently):
preprocess -> [misses only, batched with other requests' misses] image_decode -> vision_encoder ->
VisionZip -> moe_decoder (decoupled) -> postprocess per streamed response -> client.

BLS in Triton 2.51 (python backend r24.10), as it shapes this code:
- A BLS call holds one thread of the backend's per-instance pool (python backend config
  `thread-pool-size`, default 32) until its first response; client responses are sent through
  the same pool. More concurrent requests than that wait for a free thread, they do not fail.
- `exec(decoupled=True)` returns an iterator; the Python InferenceResponse does not say whether
  it is the last one, so the client gets each relayed response without flags and then a
  FINAL-only response (as the ensemble does).
- There is no way to cancel an in-flight BLS request (`ResponseIterator.cancel()` arrived in
  r25.04), and the client's cancellation does not reach the inner moe_decoder request (nor does it
  through the mm_qa ensemble: measured, the decoder generates all max_tokens). On cancellation
  this model stops relaying (no more postprocess calls or sends), reads the decoder's remaining
  responses, and only then sends the final flag. Reading to the end: the stub frees a decoupled
  BLS iterator only once it has yielded the last response (an abandoned one leaks). Final flag
  last: while the client's request is open the server does not finalize this model; sent earlier,
  a shutdown right after a cancellation finalized it while the decoder still streamed to it, and
  the stop hung for its whole exit timeout (measured).
"""
from __future__ import annotations

import queue
import re
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch
import triton_python_backend_utils as pb_utils

from ..embedding_cache import EmbeddingCache, content_key
from ..visionzip import ImageFeatures, compress, decoder_inputs
from .io import BadInput, Metrics, error_response, get_input, model_parameters, scalar, strings

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
# Client inputs handed to moe_decoder unchanged, when the client gave them.
DECODER_INPUTS = ("max_tokens", "stream", "temperature", "top_p", "top_k", "random_seed", "stop_words", "ignore_eos",
                  "sere")
ENCODER_OUTPUTS = ["visual_embeds", "deepstack_embeds", "image_grids", "visual_tokens_kept", "token_importance",
                   "token_keys"]
# moe_decoder outputs that go to the client as they are (text_output comes from postprocess).
RELAYED = ["input_token_count", "output_token_count", "finish_reason", "visual_tokens_kept"]


class ModelError(RuntimeError):
    """A composed model answered with an error; its message (naming the model) goes to the client."""


@dataclass
class Job:
    """One validated request, its inputs read in execute() (the request is released when it returns)."""
    sender: object
    question: str
    images: list[bytes]
    keep_ratio: float
    decoder_inputs: dict[str, np.ndarray]
    decoder_stream: object = None  # moe_decoder's response iterator while it is not read to its end


def bls_request(model: str, inputs: dict, outputs: list[str]):
    """inputs: numpy arrays, or tensors another model returned (passed on as they are: on a GPU,
    image_decode's pixel_values stay on the GPU on their way to vision_encoder)."""
    tensors = [v if isinstance(v, pb_utils.Tensor) else pb_utils.Tensor(k, v) for k, v in inputs.items()]
    return pb_utils.InferenceRequest(model_name=model, requested_output_names=outputs, inputs=tensors)


def infer(model: str, inputs: dict, outputs: list[str]) -> dict:
    """One BLS call to a model that is not decoupled: its output tensors by name."""
    response = bls_request(model, inputs, outputs).exec()
    check(response)
    return {name: pb_utils.get_output_tensor_by_name(response, name) for name in outputs}


def check(response) -> None:
    if response.has_error():
        raise ModelError(response.error().message())


def renumber_images(message: str, positions: list[int]) -> str:
    """image_decode and vision_encoder name an image by its index in the batch they got (the cache
    misses); the client needs its index in the request."""
    def fix(m: re.Match) -> str:
        i = int(m.group(1))
        return f"image {positions[i] if i < len(positions) else i}"
    return re.sub(r"\bimage (\d+)", fix, message)


def _owned(array: np.ndarray, index) -> torch.Tensor:
    return torch.from_numpy(array[index].copy())


def split_features(out: dict[str, np.ndarray]) -> list[ImageFeatures]:
    """vision_encoder's outputs at keep ratio 1.0 -> one ImageFeatures per image.

    All rows of all images are back to back, image by image, in token order. Each image's rows are
    copied so that a cached image holds its own memory, not a view of the whole request's."""
    counts = out["visual_tokens_kept"].reshape(-1).tolist()
    grids = [tuple(g) for g in out["image_grids"].reshape(-1, 2).tolist()]
    if counts != [rows * cols for rows, cols in grids]:
        raise RuntimeError(f"vision_encoder kept {counts} tokens of grids {grids}: not every token (keep 1.0?)")
    features, start = [], 0
    for count, grid in zip(counts, grids):
        rows = slice(start, start + count)
        start += count
        features.append(ImageFeatures(_owned(out["visual_embeds"], rows),
                                      _owned(out["deepstack_embeds"], (slice(None), rows)),
                                      _owned(out["token_importance"], rows), _owned(out["token_keys"], rows), grid))
    return features


def encode_images(images: list[bytes]) -> list[ImageFeatures]:
    """image_decode -> vision_encoder at keep ratio 1.0 (every token, with its importance and key,
    so VisionZip can run here) -> one ImageFeatures per image."""
    pixels = infer("image_decode", {"images": np.asarray(images, np.object_)}, ["pixel_values", "image_sizes"])
    out = infer("vision_encoder", {**pixels, "visual_keep_ratio": np.ones(1, np.float32)}, ENCODER_OUTPUTS)
    return split_features({name: t.as_numpy() for name, t in out.items()})


class VisionBatcher:
    """Gathers the cache misses of every request waiting and sends them through the vision tower in
    one call (at most `max_images`): concurrent requests share a vision forward. If a shared call
    fails (one request's image does not decode), each request is retried alone, so the error
    reaches only its owner."""

    def __init__(self, max_images: int):
        self.max_images = max_images
        self._queue: queue.Queue[tuple[list[bytes], Future]] = queue.Queue()
        threading.Thread(target=self._loop, name="mm_qa_bls-vision", daemon=True).start()

    def features(self, images: list[bytes]) -> list[ImageFeatures]:
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

    @staticmethod
    def _run(batch):
        try:
            features = encode_images([im for images, _ in batch for im in images])
        except Exception as e:
            if len(batch) == 1:
                batch[0][1].set_exception(e)
                return
            for job in batch:
                VisionBatcher._run([job])
            return
        start = 0
        for images, done in batch:
            done.set_result(features[start:start + len(images)])
            start += len(images)


class TritonPythonModel:
    def initialize(self, args):
        params = model_parameters(args)
        self.max_images = int(params.get("max_images", "64"))
        self.keep_ratio = float(params.get("keep_ratio", "0.6"))
        self.context_fraction = float(params.get("context_fraction", "0.05"))
        self.min_per_image = int(params.get("min_tokens_per_image", "4"))
        self.cache = EmbeddingCache(int(params.get("cache_bytes", "268435456")))
        self.vision = VisionBatcher(self.max_images)
        self._queued: dict[Future, Job] = {}  # submitted and not yet finished
        self.pool = ThreadPoolExecutor(int(params.get("max_concurrent_requests", "64")), thread_name_prefix="mm_qa_bls")
        self._metrics()

    def _metrics(self):
        self._metric_families = metrics = Metrics(pb_utils, "mm_qa_bls")
        # cache attribute -> its metric
        self._counters = {
            "hits": metrics.counter("zipmoe_bls_cache_hits_total", "Images whose vision features came from the cache"),
            "misses": metrics.counter("zipmoe_bls_cache_misses_total", "Images sent to image_decode + vision_encoder"),
            "evictions": metrics.counter("zipmoe_bls_cache_evictions_total", "Cached images evicted for space"),
            "bytes": metrics.gauge("zipmoe_bls_cache_bytes", "Bytes of vision features cached"),
        }

    def _publish_metrics(self):
        for name, metric in self._counters.items():
            metric.sync(getattr(self.cache, name))

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            try:
                job = self._parse(request, sender)
            except (BadInput, UnicodeDecodeError) as e:
                sender.send(error_response(pb_utils, f"mm_qa_bls: {e}"), flags=FINAL)
                continue
            future = self.pool.submit(self._serve, job)
            self._queued[future] = job
            future.add_done_callback(lambda f: self._queued.pop(f, None) if not f.cancelled() else None)
        return None

    def _parse(self, request, sender) -> Job:
        question = scalar(pb_utils, request, "text_input", "", str)
        if not question.strip():
            raise BadInput("text_input is empty: ask a question")
        images = strings(pb_utils, request, "images")
        if len(images) > self.max_images:
            raise BadInput(f"{len(images)} images; this deployment accepts at most {self.max_images}")
        for i, image in enumerate(images):
            if not image:
                raise BadInput(f"image {i}: empty")
        ratio = scalar(pb_utils, request, "visual_keep_ratio", self.keep_ratio, float)
        if not 0.0 < ratio <= 1.0:
            raise BadInput(f"visual_keep_ratio must be in (0, 1], got {ratio}")
        given = {name: get_input(pb_utils, request, name) for name in DECODER_INPUTS}
        return Job(sender, question, images, ratio, {k: v for k, v in given.items() if v is not None})

    # --- worker threads ------------------------------------------------------------------------

    def _serve(self, job: Job):
        final = None
        try:
            self._answer(job)
        except ModelError as e:
            final = error_response(pb_utils, str(e))
        except Exception as e:  # a bug must not leave the client waiting
            pb_utils.Logger.log_error(f"mm_qa_bls: request failed: {e!r}")
            final = error_response(pb_utils, f"mm_qa_bls failed: {e!r}")
        finally:
            if job.decoder_stream is not None:  # cancelled, or an error: see the module docstring
                for _ in job.decoder_stream:
                    pass
        job.sender.send(final, flags=FINAL)

    def _answer(self, job: Job):
        text_in = {"text_input": np.asarray([job.question.encode("utf-8")], np.object_)}
        if job.images:
            text_in["images"] = np.asarray(job.images, np.object_)
        decoder_in = {**infer("preprocess", text_in, ["input_ids"]), **job.decoder_inputs}
        if job.images:
            tokens = compress(self._features(job.images), job.keep_ratio, self.context_fraction, self.min_per_image)
            decoder_in.update(decoder_inputs(tokens))
        if job.sender.is_cancelled():
            return
        outputs = ["output_ids", "text_range", *RELAYED]
        job.decoder_stream = bls_request("moe_decoder", decoder_in, outputs).exec(decoupled=True)
        for response in job.decoder_stream:
            check(response)
            if job.sender.is_cancelled():
                return
            if not response.output_tensors():  # an empty final response
                continue
            out = {name: pb_utils.get_output_tensor_by_name(response, name) for name in outputs}
            text = infer("postprocess", {name: out[name] for name in ("output_ids", "text_range")}, ["text_output"])
            job.sender.send(pb_utils.InferenceResponse([text["text_output"]] + [out[name] for name in RELAYED]))
        job.decoder_stream = None

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
        self._publish_metrics()
        return [found[key] for key in keys]

    def finalize(self):
        self.pool.shutdown(wait=True, cancel_futures=True)
        # Requests still queued were cancelled above: each still needs its final response, or the
        # server's shutdown waits for it.
        for future, job in list(self._queued.items()):
            if future.cancelled():
                job.sender.send(error_response(pb_utils, "the server is shutting down"), flags=FINAL)
