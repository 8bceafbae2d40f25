"""`moe_decoder`: the Triton adapter of `serving.decoder.DecoderService` (decoupled).

execute() turns each request into a `DecodeRequest` and a sink around its response sender, hands
it to the service and returns at once; the service's engine thread streams the answers back
through the sink. Errors in a request become a TritonError for that request alone.
"""
from __future__ import annotations

import numpy as np
import torch
import triton_python_backend_utils as pb_utils

from ..detokenize import TokenBytes
from ..engine.engine import LLMEngine, RequestError
from ..serving.decoder import COUNTERS, GAUGES, DecodeRequest, DecodeResponse, DecoderService, VisualTokens
from ..serving.errors import BadInput
from ..serving.interface import DECODER_OPTIONS, VISUAL_TOKENS
from .io import Metrics, error_response, get_input, load_settings, read_options, resolve_checkpoint

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL

class Sink:
    """One request's response sender, as the service's ResponseSink."""

    def __init__(self, sender):
        self.sender = sender

    def send(self, response: DecodeResponse | None, final: bool) -> None:
        flags = FINAL if final else 0
        if response is None:
            self.sender.send(None, flags=flags)
            return
        out = [
            pb_utils.Tensor("output_ids", response.output_ids),
            pb_utils.Tensor("text_range", np.asarray(response.text_range, dtype=np.int32)),
            pb_utils.Tensor("input_token_count", np.asarray([response.input_token_count], dtype=np.int32)),
            pb_utils.Tensor("output_token_count", np.asarray([response.output_token_count], dtype=np.int32)),
            pb_utils.Tensor("finish_reason", np.asarray([response.finish_reason.encode()], dtype=np.object_)),
            pb_utils.Tensor("visual_tokens_kept", response.visual_tokens_kept),
        ]
        self.sender.send(pb_utils.InferenceResponse(output_tensors=out), flags=flags)

    def send_error(self, message: str) -> None:
        self.sender.send(error_response(pb_utils, message), flags=FINAL)

    def is_cancelled(self) -> bool:
        return self.sender.is_cancelled()


def visual_tokens(request) -> VisualTokens | None:
    arrays = {name: get_input(pb_utils, request, name) for name in VISUAL_TOKENS}
    if arrays["visual_tokens_kept"] is None:
        return None
    tensors = {name: None if a is None else torch.from_numpy(a) for name, a in arrays.items()}
    return VisualTokens(tensors["visual_embeds"], tensors["deepstack_embeds"], tensors["visual_positions"],
                        tensors["image_grids"], tensors["visual_tokens_kept"])


class TritonPythonModel:
    def initialize(self, args):
        location, service_config, engine_config = load_settings(args, "moe_decoder")
        checkpoint = resolve_checkpoint(args, location.checkpoint_path)
        engine = LLMEngine(checkpoint, engine_config)
        pb_utils.Logger.log_info(f"moe_decoder: {checkpoint} on {engine.device} ({engine.dtype}), "
                                 f"{engine_config.num_kv_blocks} KV blocks of {engine_config.block_size} tokens")
        self._metric_families = families = Metrics(pb_utils, "moe_decoder")
        self.metrics = {**{k: families.counter(*v) for k, v in COUNTERS.items()},
                        **{k: families.gauge(*v) for k, v in GAUGES.items()}}
        self.service = DecoderService(engine, TokenBytes.from_tokenizer_json(checkpoint), service_config,
                                      publish=self._publish, log_error=pb_utils.Logger.log_error)

    def _publish(self, stats: dict[str, int]) -> None:
        for name, metric in self.metrics.items():
            metric.sync(stats[name])

    def execute(self, requests):
        for request in requests:
            sink = Sink(request.get_response_sender())
            try:
                ids = pb_utils.get_input_tensor_by_name(request, "input_ids").as_numpy().reshape(-1).tolist()
                options = read_options(pb_utils, request, DECODER_OPTIONS)
                self.service.submit(DecodeRequest(ids, options, visual_tokens(request)), sink)
            except (BadInput, RequestError) as e:
                sink.send_error(str(e))
        return None

    def finalize(self):
        self.service.shutdown()
