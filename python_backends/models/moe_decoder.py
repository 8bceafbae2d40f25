"""`moe_decoder`: the Triton adapter of `serving.decoder.DecoderService` (decoupled).

execute() turns each request into a `DecodeRequest` and a sink around its response sender, hands
it to the service and returns at once; the service's engine thread streams the answers back
through the sink. Errors in a request become a TritonError for that request alone.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch
import triton_python_backend_utils as pb_utils

from ..detokenize import TokenBytes
from ..engine.engine import RequestError
from ..engine.parallel_engine import make_engine
from ..serving.decode_request import DecodeRequest, DecodeResponse, VisualTokens
from ..serving.decoder import DecoderService
from ..serving.decoder_metrics import COUNTERS, GAUGES, HISTOGRAMS
from ..serving.device_loss import device_lost, lost_message
from ..serving.doorbell import Ring
from ..serving.errors import BadInput, ServerBusy, internal_error
from ..serving.interface import DECODER_OPTIONS, VISUAL_TOKENS
from ..serving.gpu_turn import TurnWaiter, turn_path
from ..serving.shared_level import LevelWriter, segment_path
from ..settings import resolve_device
from .io import (Metrics, as_torch, error_response, get_input, instance_gpu, instance_labels, load_settings,
                 read_options, resolve_checkpoint, scalar)
from .stub_safety import requested_outputs

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL

class Sink:
    """One request's response sender, as the service's ResponseSink. It builds only the outputs the
    request asked for: the stub must drop none (stub_safety). A BLS caller that gave a doorbell
    (serving/doorbell.py) hears one ring per response, once the response is in its hands."""

    def __init__(self, sender, wanted: frozenset[str], ring: Ring | None = None):
        self.sender, self.wanted, self.ring = sender, wanted, ring

    def _send(self, response, flags: int) -> None:
        self.sender.send(response, flags=flags)
        if self.ring is not None:
            self.ring.ring()

    def send(self, response: DecodeResponse | None, final: bool) -> None:
        flags = FINAL if final else 0
        if response is None:
            self._send(None, flags)
            return
        arrays = {
            "output_ids": response.output_ids,
            "text_range": np.asarray(response.text_range, dtype=np.int32),
            "input_token_count": np.asarray([response.input_token_count], dtype=np.int32),
            "output_token_count": np.asarray([response.output_token_count], dtype=np.int32),
            "finish_reason": np.asarray([response.finish_reason.encode()], dtype=np.object_),
            "visual_tokens_kept": response.visual_tokens_kept,
            "visual_keep_ratio_used": np.asarray([response.visual_keep_ratio_used], dtype=np.float32),
        }
        out = [pb_utils.Tensor(name, value) for name, value in arrays.items() if name in self.wanted]
        self._send(pb_utils.InferenceResponse(output_tensors=out), flags)

    def send_error(self, message: str, busy: bool = False) -> None:
        self._send(error_response(pb_utils, message, busy), FINAL)

    def is_cancelled(self) -> bool:
        return self.sender.is_cancelled()


def visual_tokens(request, device: torch.device) -> VisualTokens | None:
    """vision_encoder's tensors through DLPack, where they are (config: FORCE_CPU_ONLY_INPUT_TENSORS no).
    The embeddings are copied into this model's own memory on its device (device to device when both
    are on the GPU: the request's buffers go back to Triton while the sequence still runs); the
    small index tensors go to the host, where the prompt is spliced."""
    given = {name: pb_utils.get_input_tensor_by_name(request, name) for name in VISUAL_TOKENS}
    if given["visual_tokens_kept"] is None:
        return None
    t = {name: None if v is None else as_torch(v) for name, v in given.items()}
    features = {name: None if t[name] is None else t[name].to(device, copy=True)
                for name in ("visual_embeds", "deepstack_embeds")}
    if device.type == "cuda":  # the copy is queued on the stream: finish it before Triton frees the source
        torch.cuda.current_stream(device).synchronize()
    index = {name: None if t[name] is None else t[name].cpu()
             for name in ("visual_positions", "image_grids", "visual_tokens_kept")}
    return VisualTokens(features["visual_embeds"], features["deepstack_embeds"], index["visual_positions"],
                        index["image_grids"], index["visual_tokens_kept"])


class TritonPythonModel:
    def initialize(self, args):
        location, service_config, degradation, engine_config = load_settings(args, "moe_decoder")
        checkpoint = resolve_checkpoint(args, location.checkpoint_path)
        # On a KIND_GPU instance, device auto is the GPU Triton gave it: one engine per listed GPU.
        engine_config = replace(engine_config, device=resolve_device(engine_config.device, instance_gpu(args)))
        engine = make_engine(checkpoint, engine_config)  # expert_parallel_size > 1: N processes, N GPUs
        pb_utils.Logger.log_info(f"moe_decoder: {checkpoint} ({engine_config.load_format}) on {engine.device} "
                                 f"({engine.dtype}), KV cache of {engine.blocks.num_blocks} blocks: "
                                 f"{engine.kv_capacity_tokens} tokens, experts split over "
                                 f"{engine_config.expert_parallel_size} process(es)")
        self.engine = engine
        self._metric_families = families = Metrics(pb_utils, "moe_decoder", instance_labels(args))
        self.metrics = {**{k: families.counter(*v) for k, v in COUNTERS.items()},
                        **{k: families.gauge(*v) for k, v in GAUGES.items()}}
        self.histograms = {k: families.histogram(*v) for k, v in HISTOGRAMS.items()}
        self.device = engine.device
        # The degradation level, for vision_encoder and mm_qa_bls (serving/shared_level.py).
        self.level = LevelWriter(segment_path(args["model_repository"]))
        self.service = DecoderService(engine, TokenBytes.from_tokenizer_json(checkpoint), service_config,
                                      publish=self._publish, log_error=pb_utils.Logger.log_error,
                                      observe=lambda name, value: self.histograms[name].observe(value),
                                      degradation=degradation, on_level=self._on_level,
                                      gpu_turn=TurnWaiter(turn_path(args["model_repository"], self.device)))

    def _on_level(self, level: int, why: str) -> None:
        self.level.write(level)
        pb_utils.Logger.log_info(f"moe_decoder: degradation level {level} ({why})")

    def _publish(self, stats: dict[str, float]) -> None:
        for name, metric in self.metrics.items():
            metric.sync(stats[name])

    def execute(self, requests):
        for request in requests:
            sink = Sink(request.get_response_sender(), requested_outputs(request))
            try:
                doorbell = scalar(pb_utils, request, "response_doorbell", None, str)
                if doorbell is not None:
                    sink.ring = Ring(doorbell, scalar(pb_utils, request, "request_tag", "", str))
                cancel = scalar(pb_utils, request, "cancel", None, str)
                if cancel is not None:  # a control call: stop the request tagged so, answer this one at once
                    self.service.cancel(cancel)
                    sink.send(None, final=True)
                    continue
                ids = get_input(pb_utils, request, "input_ids")
                if ids is None:
                    raise BadInput("input_ids is required")
                options = read_options(pb_utils, request, DECODER_OPTIONS)
                tag = scalar(pb_utils, request, "request_tag", "", str)
                # Rounded back from FP32 (0.3 arrives as 0.30000001) so that it falls in the histogram's le="0.3".
                keep = round(scalar(pb_utils, request, "visual_keep_ratio_used", 1.0, float), 6)
                self.service.submit(DecodeRequest(ids.reshape(-1).tolist(), options,
                                                  visual_tokens(request, self.device), tag, keep), sink)
            except (BadInput, RequestError) as e:
                sink.send_error(str(e))
            except ServerBusy as e:
                sink.send_error(str(e), busy=True)
            except Exception as e:  # a bug or a device error fails this request alone, never the batch
                pb_utils.Logger.log_error(f"moe_decoder: request refused: {e!r}")
                if device_lost(e, self.device):  # no later request could be served either
                    sink.send_error(lost_message("moe_decoder", e))
                    self.service.lose_device(e)
                    continue
                sink.send_error(internal_error("moe_decoder", e))
        return None

    def finalize(self):
        self.service.shutdown()
        self.engine.close()
        self.level.close()
        self._metric_families.close()  # after the engine thread: a late publish then sends nothing
