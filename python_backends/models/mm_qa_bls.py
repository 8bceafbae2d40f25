"""`mm_qa_bls`: the Triton adapter of `serving.pipeline.QAPipeline` (decoupled, BLS).

Same client interface and answers as the mm_qa ensemble. execute() turns each request into a
`QARequest` and a sink around its response sender and returns at once; the pipeline answers on
its worker threads, reaching the other models through `BlsCalls` below. VisionZip's settings are
read from vision_encoder/config.pbtxt, so both paths compress alike.

BLS in Triton 2.51 (python backend r24.10), as it shapes this code:
- A BLS call holds one thread of the backend's per-instance pool (python backend config
  `thread-pool-size`, default 32) until its first response; client responses are sent through
  the same pool. More concurrent requests than that wait for a free thread, they do not fail.
- `exec(decoupled=True)` returns an iterator; the Python InferenceResponse does not say whether
  it is the last one. The decoder's last response is the one with a finish_reason: the client gets
  it with the final flag once the decoder's stream has ended, as through the ensemble, and no empty
  final response (perf_analyzer 2.51 recorded one with garbage outputs and at times wrote an empty
  profile export). A cancelled or failed request still ends with a FINAL-only response.
- Readers of a decoupled BLS stream must not wait inside its iterator: with several threads reading
  and starting streams, the stub can deadlock (serving/doorbell.py). moe_decoder rings a doorbell
  after each response it hands over; a stream reads one response per ring.
- A decoupled BLS stream can end before its first response, its responses lost: seen under a burst
  of moe_decoder's busy refusals on a loaded 2-core machine (docs/OPERATIONS.md, "Overload"). moe_decoder
  answers every request at least once, so DecoderStream raises StreamLost and the pipeline stops the
  call (by its tag) and asks again.
- There is no way to cancel an in-flight BLS request (`ResponseIterator.cancel()` arrived in
  r25.04), and the client's cancellation does not reach the inner moe_decoder request (nor does it
  through the mm_qa ensemble); the pipeline reads the decoder to its end (serving/pipeline.py).
"""
from __future__ import annotations

import uuid
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

from ..image_input import decode_images
from ..serving import doorbell
from ..serving.doorbell import Doorbells
from ..serving.errors import SERVER_BUSY, BadInput, ModelError, ServerBusy, StreamLost, internal_error
from ..serving.interface import DECODER_OPTIONS
from ..serving.load import DEFAULT_PRIORITY, DEGRADABLE, DEGRADED
from ..serving.pipeline import GAUGES, METRICS, QAPipeline, QARequest, split_features
from ..serving.shared_level import LevelReader, segment_path
from ..settings import parse_parameters, settings_of
from ..visionzip import VisionZipConfig
from .io import (Metrics, as_torch, as_triton, error_response, get_input, instance_labels, load_settings, scalar,
                 strings)
from .stub_safety import Keepalive, requested_outputs

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
ENCODER_OUTPUTS = ["visual_embeds", "deepstack_embeds", "image_grids", "visual_tokens_kept", "token_importance",
                   "token_keys"]
DECODER_OUTPUTS = ["output_ids", "text_range", "input_token_count", "output_token_count", "finish_reason",
                   "visual_tokens_kept", "visual_keep_ratio_used"]
# Finished decoupled BLS iterators, held until the stub's clean-up thread has let go of them (stub_safety).
FINISHED_CALLS = Keepalive()


def bls_request(model: str, inputs: dict, outputs: list[str]):
    """inputs: numpy arrays, or tensors another model returned (passed on as they are: on a GPU,
    image_decode's pixel_values stay on the GPU on their way to vision_encoder)."""
    tensors = [v if isinstance(v, pb_utils.Tensor) else as_triton(pb_utils, k, v) for k, v in inputs.items()]
    return pb_utils.InferenceRequest(model_name=model, requested_output_names=outputs, inputs=tensors)


def check(response) -> None:
    """Raises the error a composed model answered. moe_decoder's busy error is known by its phrase: a
    BLS response of server 2.51 keeps only the message (request_executor.cc: every code is INTERNAL)."""
    if response.has_error():
        message = response.error().message()
        raise (ServerBusy if message.startswith(SERVER_BUSY) else ModelError)(message)


def infer(model: str, inputs: dict, outputs: list[str]) -> dict:
    """One BLS call to a model that is not decoupled: its output tensors by name."""
    response = bls_request(model, inputs, outputs).exec()
    check(response)
    return {name: pb_utils.get_output_tensor_by_name(response, name) for name in outputs}


def ends_answer(finish_reason) -> bool:
    """A moe_decoder response's finish_reason tensor says the answer ends here (empty until then)."""
    return bool(finish_reason.as_numpy().reshape(-1)[0])


class DecoderStream:
    """moe_decoder's responses to the request tagged `tag`; whatever iteration leaves unread, drain() reads.
    Each response is read once its doorbell rang, so no thread waits inside the stub's iterator
    (serving/doorbell.py: the deadlock that waiting there can close)."""

    def __init__(self, responses, tag: str, bells: Doorbells, bell):
        self._responses, self._tag, self._bells, self._bell = responses, tag, bells, bell
        self._ended = False  # the last response was read: the iterator now ends without waiting
        self._read = 0  # responses read: none at the end is a lost stream (serving.errors.StreamLost)

    def cancel(self) -> None:
        """A control call to moe_decoder naming this request's tag (answered at once, read to its end)."""
        call = bls_request("moe_decoder", {"cancel": np.asarray([self._tag.encode()], np.object_)},
                           []).exec(decoupled=True)
        for _ in call:
            pass
        FINISHED_CALLS.hold(call)

    def _next(self):
        """The next response once it is buffered, or None when the stream has ended."""
        if self._responses is None:  # read to its end (and handed to FINISHED_CALLS) already
            return None
        if not self._ended and not doorbell.wait(self._bell):
            pb_utils.Logger.log_warn(f"mm_qa_bls: no doorbell from moe_decoder for {doorbell.RING_TIMEOUT_S:g} s "
                                     f"(stream {self._tag}): reading anyway")
        try:
            response = next(self._responses)
        except StopIteration:
            self._bells.discard(self._tag)
            FINISHED_CALLS.hold(self._responses)
            self._responses = None
            return None
        self._read += 1
        # moe_decoder's last response of a stream: an error, the empty final one, or the one with a finish_reason.
        self._ended = response.has_error() or not response.output_tensors() or ends_answer(
            pb_utils.get_output_tensor_by_name(response, "finish_reason"))
        return response

    def __iter__(self):
        while (response := self._next()) is not None:
            check(response)
            if response.output_tensors():  # not the empty final response
                yield {name: pb_utils.get_output_tensor_by_name(response, name) for name in DECODER_OUTPUTS}
        if not self._read:
            raise StreamLost(f"moe_decoder's stream {self._tag} ended before its first response")

    def drain(self) -> None:
        while self._next() is not None:
            pass


class BlsCalls:
    """serving.pipeline.ModelCalls through BLS. `bells`: this process's doorbells for decoder streams."""

    def __init__(self, bells: Doorbells):
        self.bells = bells

    @staticmethod
    def tokenize(question: str, image_count: int):
        text_in = {"text_input": np.asarray([question.encode("utf-8")], np.object_)}
        if image_count:  # preprocess reads only how many images came (their tensor's shape), not their bytes
            text_in["images"] = np.full(image_count, b"", np.object_)
        return infer("preprocess", text_in, ["input_ids"])["input_ids"]

    @staticmethod
    def encode_images(images: list[bytes]):
        """image_decode -> vision_encoder at keep ratio 1.0 and priority 0, never degraded (every token,
        with its importance and key, so VisionZip can run in the pipeline) -> one ImageFeatures per image."""
        pixels = infer("image_decode", {"images": np.asarray(images, np.object_)}, ["pixel_values", "image_sizes"])
        out = infer("vision_encoder", {**pixels, "visual_keep_ratio": np.ones(1, np.float32),
                                       "priority": np.zeros(1, np.int32)}, ENCODER_OUTPUTS)
        return split_features({name: as_torch(t) for name, t in out.items()})

    def decode(self, inputs: dict) -> DecoderStream:
        tag = uuid.uuid4().hex  # names the call for DecoderStream.cancel and for its doorbell
        inputs = {**inputs, "request_tag": np.asarray([tag.encode()], np.object_),
                  "response_doorbell": np.asarray([self.bells.path.encode()], np.object_)}
        bell = self.bells.open(tag)  # before the call: its first rings may come before exec() returns
        try:
            responses = bls_request("moe_decoder", inputs, DECODER_OUTPUTS).exec(decoupled=True)
        except Exception:
            self.bells.discard(tag)
            raise
        return DecoderStream(responses, tag, self.bells, bell)

    @staticmethod
    def is_last(outputs: dict) -> bool:
        return ends_answer(outputs["finish_reason"])

    @staticmethod
    def detokenize(outputs: dict) -> bytes:
        window = {name: outputs[name] for name in ("output_ids", "text_range")}
        return infer("postprocess", window, ["text_output"])["text_output"].as_numpy().reshape(-1)[0]


class Sink:
    def __init__(self, sender, wanted: frozenset[str]):
        self.sender, self.wanted = sender, wanted

    def send(self, outputs: dict, final: bool = False) -> None:
        """Only the outputs the client asked for: the stub must drop none (stub_safety)."""
        self.sender.send(pb_utils.InferenceResponse([t if isinstance(t, pb_utils.Tensor) else as_triton(pb_utils, n, t)
                                                     for n, t in outputs.items() if n in self.wanted]),
                         flags=FINAL if final else 0)

    def close(self, error: str | None, busy: bool = False) -> None:
        self.sender.send(None if error is None else error_response(pb_utils, error, busy), flags=FINAL)

    def is_cancelled(self) -> bool:
        return self.sender.is_cancelled()


def vision_encoder_visionzip(args: dict) -> VisionZipConfig:
    """VisionZip's settings as vision_encoder/config.pbtxt (beside this model's) sets them."""
    from google.protobuf import json_format, text_format
    from tritonclient.grpc import model_config_pb2

    path = Path(args["model_repository"]).resolve().parent / "vision_encoder" / "config.pbtxt"
    config = text_format.Parse(path.read_text(), model_config_pb2.ModelConfig())
    params = {k: v["stringValue"] for k, v in json_format.MessageToDict(config).get("parameters", {}).items()}
    return parse_parameters({k: v for k, v in params.items() if k in settings_of(VisionZipConfig)},
                            VisionZipConfig, model="vision_encoder")[0]


class TritonPythonModel:
    def initialize(self, args):
        (config,) = load_settings(args, "mm_qa_bls")
        self._metric_families = families = Metrics(pb_utils, "mm_qa_bls", instance_labels(args))
        self.metrics = {name: (families.gauge if name in GAUGES else families.counter)(*metric)
                        for name, metric in METRICS.items()}
        self.degraded = families.labelled_counters(*DEGRADED, "priority", DEGRADABLE)
        self.bells = Doorbells()
        self.pipeline = QAPipeline(BlsCalls(self.bells), config, vision_encoder_visionzip(args), publish=self._publish,
                                   log_error=pb_utils.Logger.log_error,
                                   level=LevelReader(segment_path(args["model_repository"])).read)

    def _publish(self, stats: dict[str, int]) -> None:
        for name, metric in self.metrics.items():
            metric.sync(stats[name])
        for priority, metric in self.degraded.items():
            metric.sync(self.pipeline.keep.degraded[priority])

    def execute(self, requests):
        for request in requests:
            sink = Sink(request.get_response_sender(), requested_outputs(request))
            try:
                ratio = scalar(pb_utils, request, "visual_keep_ratio", None, float)
                given = {name: get_input(pb_utils, request, name) for name in DECODER_OPTIONS}
                images = decode_images(strings(pb_utils, request, "images"))  # base64 over HTTP -> file bytes
                qa = QARequest(scalar(pb_utils, request, "text_input", "", str), images, ratio,
                               {k: v for k, v in given.items() if v is not None},
                               scalar(pb_utils, request, "priority", DEFAULT_PRIORITY, int))
                self.pipeline.submit(qa, sink)
            except (BadInput, UnicodeDecodeError) as e:
                sink.close(f"mm_qa_bls: {e}")
            except ServerBusy as e:
                sink.close(str(e), busy=True)
            except Exception as e:  # a bug fails this request alone, never the batch
                pb_utils.Logger.log_error(f"mm_qa_bls: request refused: {e!r}")
                sink.close(internal_error("mm_qa_bls", e))
        return None

    def finalize(self):
        self.pipeline.shutdown()
        self.bells.close()
        self._metric_families.close()  # after the workers: a late publish then sends nothing
