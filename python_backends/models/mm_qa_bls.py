"""`mm_qa_bls`: the mm_qa pipeline composed through BLS, with logic an ensemble cannot express.

Same client interface and answers as the mm_qa ensemble; in addition: requests are validated before
any work, and each image's vision features are cached by content hash, so an image seen before
skips decoding and the vision tower. The cache holds features *before* VisionZip (vision_encoder
runs at keep ratio 1.0 and also returns every token's importance and key); VisionZip then runs here
over all images of the request, cached or not, under the request's one token budget.

Per request, on a worker thread (execute() returns at once, so streams run concurrently):
preprocess -> [misses only] image_decode -> vision_encoder -> VisionZip -> moe_decoder (decoupled)
-> postprocess per streamed response -> client.

BLS in Triton 2.51 (python backend r24.10), as it shapes this code:
- A BLS call holds one thread of the backend's per-instance pool (python backend config
  `thread-pool-size`, default 32) until its first response; client responses are sent through
  the same pool. More concurrent requests than that wait for a free thread, they do not fail.
- `exec(decoupled=True)` returns an iterator; the Python InferenceResponse does not say whether
  it is the last one, so the client gets each relayed response without flags and then a
  FINAL-only response (as the ensemble does).
- There is no way to cancel an in-flight BLS request (`ResponseIterator.cancel()` arrived in
  r25.04), and the client's cancellation does not reach the inner moe_decoder request. On
  cancellation this model stops relaying and closes the client's stream at once; the decoder
  still runs the inner request to its end, and the dropped iterator waits for that end (its
  destructor drains the remaining responses), keeping the worker thread busy until then.
"""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch
import triton_python_backend_utils as pb_utils

from ..embedding_cache import EmbeddingCache, content_key
from ..visionzip import ImageFeatures, ImageTokens, compress
from .io import BadInput, error_response, get_input, model_parameters, scalar, strings

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
# Client inputs handed to moe_decoder unchanged, when the client gave them.
DECODER_INPUTS = ("max_tokens", "stream", "temperature", "top_p", "top_k", "random_seed", "stop_words", "ignore_eos")
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


def infer(model: str, inputs: dict[str, np.ndarray], outputs: list[str], decoupled: bool = False):
    request = pb_utils.InferenceRequest(model_name=model, requested_output_names=outputs,
                                        inputs=[pb_utils.Tensor(name, value) for name, value in inputs.items()])
    if decoupled:
        return request.exec(decoupled=True)
    response = request.exec()
    check(response)
    return {name: pb_utils.get_output_tensor_by_name(response, name).as_numpy() for name in outputs}


def check(response) -> None:
    if response.has_error():
        raise ModelError(response.error().message())


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

        def own(array: np.ndarray, index) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(array[index]).copy())

        features.append(ImageFeatures(own(out["visual_embeds"], rows), own(out["deepstack_embeds"], (slice(None), rows)),
                                      own(out["token_importance"], rows), own(out["token_keys"], rows), grid))
    return features


def visual_inputs(tokens: list[ImageTokens]) -> dict[str, np.ndarray]:
    """moe_decoder's visual inputs, as the ensemble maps them from vision_encoder."""
    return {
        "visual_embeds": torch.cat([t.embeds for t in tokens]).float().numpy(),
        "deepstack_embeds": torch.cat([t.deepstack for t in tokens], dim=1).float().numpy(),
        "visual_positions": torch.cat([t.positions for t in tokens]).int().numpy(),
        "image_grids": np.asarray([t.grid for t in tokens], np.int32).reshape(-1, 2),
        "visual_tokens_kept": np.asarray([t.embeds.shape[0] for t in tokens], np.int32),
    }


class TritonPythonModel:
    def initialize(self, args):
        params = model_parameters(args)
        self.max_images = int(params.get("max_images", "64"))
        self.keep_ratio = float(params.get("keep_ratio", "0.6"))
        self.context_fraction = float(params.get("context_fraction", "0.05"))
        self.min_per_image = int(params.get("min_tokens_per_image", "4"))
        self.cache = EmbeddingCache(int(params.get("cache_bytes", "268435456")))
        self.pool = ThreadPoolExecutor(int(params.get("max_concurrent_requests", "64")), thread_name_prefix="mm_qa_bls")
        self._metrics()

    def _metrics(self):
        self._families = []  # a Metric is only valid while its MetricFamily lives

        def metric(kind, name, desc):
            family = pb_utils.MetricFamily(name=name, description=desc, kind=kind)
            self._families.append(family)
            return family.Metric(labels={"model": "mm_qa_bls"})

        counter, gauge = pb_utils.MetricFamily.COUNTER, pb_utils.MetricFamily.GAUGE
        # cache attribute -> its metric; published as deltas since the last publication
        self._published = {
            "hits": metric(counter, "zipmoe_bls_cache_hits_total", "Images whose vision features came from the cache"),
            "misses": metric(counter, "zipmoe_bls_cache_misses_total", "Images sent to image_decode + vision_encoder"),
            "evictions": metric(counter, "zipmoe_bls_cache_evictions_total", "Cached images evicted for space"),
        }
        self._bytes_gauge = metric(gauge, "zipmoe_bls_cache_bytes", "Bytes of vision features in the cache")
        self._last = dict.fromkeys(self._published, 0)
        self._metrics_lock = threading.Lock()

    def _publish_metrics(self):
        # Each increment/set is a round trip to the server; the lock keeps two workers from
        # publishing the same delta twice.
        with self._metrics_lock:
            for name, metric in self._published.items():
                value = getattr(self.cache, name)
                if value != self._last[name]:
                    metric.increment(value - self._last[name])
                    self._last[name] = value
            self._bytes_gauge.set(self.cache.bytes)

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            try:
                job = self._parse(request, sender)
            except (BadInput, UnicodeDecodeError) as e:
                sender.send(error_response(pb_utils, f"mm_qa_bls: {e}"), flags=FINAL)
                continue
            self.pool.submit(self._serve, job)
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
        try:
            self._answer(job)
        except ModelError as e:
            job.sender.send(error_response(pb_utils, str(e)), flags=FINAL)
        except Exception as e:  # a bug must not leave the client waiting
            pb_utils.Logger.log_error(f"mm_qa_bls: request failed: {e!r}")
            job.sender.send(error_response(pb_utils, f"mm_qa_bls failed: {e!r}"), flags=FINAL)

    def _answer(self, job: Job):
        text_in = {"text_input": np.asarray([job.question.encode("utf-8")], np.object_)}
        if job.images:
            text_in["images"] = np.asarray(job.images, np.object_)
        decoder_in = {"input_ids": infer("preprocess", text_in, ["input_ids"])["input_ids"], **job.decoder_inputs}
        if job.images:
            tokens = compress(self._features(job.images), job.keep_ratio, self.context_fraction, self.min_per_image)
            decoder_in.update(visual_inputs(tokens))
        if job.sender.is_cancelled():
            job.sender.send(flags=FINAL)
            return
        for response in infer("moe_decoder", decoder_in, ["output_ids", "text_range", *RELAYED], decoupled=True):
            check(response)
            if job.sender.is_cancelled():
                break  # see the module docstring: the inner request cannot be cancelled in 2.51
            if not response.output_tensors():  # an empty final response
                continue
            window = {name: pb_utils.get_output_tensor_by_name(response, name).as_numpy()
                      for name in ("output_ids", "text_range")}
            text = infer("postprocess", window, ["text_output"])["text_output"]
            job.sender.send(pb_utils.InferenceResponse(
                [pb_utils.Tensor("text_output", text)] + [pb_utils.get_output_tensor_by_name(response, name)
                                                          for name in RELAYED]))
        job.sender.send(flags=FINAL)

    def _features(self, images: list[bytes]) -> list[ImageFeatures]:
        """Each image's features, from the cache or (the misses, once each, in one call) the vision tower."""
        keys = [content_key(image) for image in images]
        found = {key: self.cache.get(key) for key in dict.fromkeys(keys)}
        missing = [key for key, value in found.items() if value is None]
        if missing:
            first = {key: image for key, image in reversed(list(zip(keys, images)))}  # key -> its image
            pixels = infer("image_decode", {"images": np.asarray([first[k] for k in missing], np.object_)},
                           ["pixel_values", "image_sizes"])
            # keep 1.0: every token, with its importance and key, so VisionZip can run here per request
            out = infer("vision_encoder", {**pixels, "visual_keep_ratio": np.ones(1, np.float32)}, ENCODER_OUTPUTS)
            for key, value in zip(missing, split_features(out)):
                self.cache.put(key, value)
                found[key] = value
        self._publish_metrics()
        return [found[key] for key in keys]

    def finalize(self):
        self.pool.shutdown(wait=True, cancel_futures=True)
