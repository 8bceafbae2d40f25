"""moe_decoder's requests and responses as `DecoderService` takes and gives them, and what a request
becomes for the engine: its sampling parameters, and its prompt with each image's kept tokens
spliced in (checked, so that a bad request is refused before it joins a batched step)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from ..checkpoint import TextConfig
from ..engine.multimodal import VisualInputs, splice_images
from ..engine.sequence import SamplingParams
from .errors import BadInput


@dataclass
class VisualTokens:
    """vision_encoder's kept tokens of one request (interface.VISUAL_TOKENS)."""
    embeds: torch.Tensor  # [V, hidden]
    deepstack: torch.Tensor  # [layers, V, hidden]
    positions: torch.Tensor  # [V, 2] (row, col) in each image's merged grid
    grids: torch.Tensor  # [images, 2]
    kept: torch.Tensor  # [images] tokens kept per image


@dataclass
class DecodeRequest:
    input_ids: list[int]  # the prompt, one placeholder per image
    options: dict  # interface.DECODER_OPTIONS by name, defaults filled in (max_tokens None: the server's)
    visual: VisualTokens | None = None  # None or no images: a text-only request
    tag: str = ""  # names the request for a later cancel(tag) (mm_qa_bls: server 2.51's BLS cannot cancel)
    keep_ratio: float = 1.0  # the keep ratio VisionZip used (echoed; 1.0: no VisionZip before this model)


@dataclass
class DecodeResponse:
    output_ids: np.ndarray  # int32 window of generated ids ...
    text_range: tuple[int, int]  # ... and the byte range of it that is new text
    input_token_count: int
    output_token_count: int
    finish_reason: str  # empty until the last response
    visual_tokens_kept: np.ndarray  # int32, per image (echoed in every response)
    visual_keep_ratio_used: float  # echoed in every response


class ResponseSink(Protocol):
    """Where one request's responses go (the adapter wraps Triton's response sender). A send may
    raise when the client has gone away."""

    def send(self, response: DecodeResponse | None, final: bool) -> None: ...  # None + final: just "done"
    def send_error(self, message: str, busy: bool = False) -> None: ...  # the final response; busy: ServerBusy
    def is_cancelled(self) -> bool: ...


def sampling_params(options: dict, default_max_tokens: int) -> SamplingParams:
    max_tokens = options.get("max_tokens")
    return SamplingParams(
        max_tokens=default_max_tokens if max_tokens is None else int(max_tokens),
        temperature=float(options.get("temperature", 0.0)), top_p=float(options.get("top_p", 1.0)),
        top_k=int(options.get("top_k", 0)), seed=options.get("random_seed"),
        stop=tuple(s for s in options.get("stop_words", ()) if s), ignore_eos=bool(options.get("ignore_eos", False)))


def splice(request: DecodeRequest, text: TextConfig) -> tuple[list[int], VisualInputs | None, np.ndarray, int]:
    """Expands each image placeholder to the tokens the vision encoder kept (none for text-only);
    also returns the kept tokens per image and the images' tokens before VisionZip."""
    v = request.visual
    if v is None or v.kept.numel() == 0:
        return request.input_ids, None, np.zeros(0, np.int32), 0
    kept = v.kept.reshape(-1).int()
    width, total, images = text.hidden_size, int(kept.sum()), kept.numel()
    # Everything must describe the same kept tokens: a request that does not is refused here, not
    # in the middle of a batched step (where it would fail the other requests).
    shapes = {"visual_embeds": (v.embeds, (total, width)), "visual_positions": (v.positions, (total, 2)),
              "image_grids": (v.grids, (images, 2))}
    for name, (tensor, shape) in shapes.items():
        if tensor is None or tuple(tensor.shape) != shape:
            got = None if tensor is None else list(tensor.shape)
            raise BadInput(f"{name} must have shape {list(shape)} for visual_tokens_kept {kept.tolist()}, got {got}")
    if v.deepstack is None or v.deepstack.ndim != 3 or tuple(v.deepstack.shape[1:]) != (total, width):
        raise BadInput(f"deepstack_embeds must have shape [layers, {total}, {width}]")
    grids = [tuple(g) for g in v.grids.tolist()]
    try:
        ids, pos, delta = splice_images(request.input_ids, text.image_token_id, kept.tolist(),
                                        v.positions, grids)
    except ValueError as e:
        raise BadInput(str(e)) from None
    before = sum(rows * cols for rows, cols in grids)
    return ids, VisualInputs(v.embeds, v.deepstack, pos, delta), kept.numpy(), before
