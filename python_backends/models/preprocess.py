"""`preprocess`: question (+ images) -> prompt token ids through the checkpoint's chat template.

The images come as the client sent them (file bytes over gRPC, base64 text over HTTP generate) and
go on to image_decode as file bytes (`image_input.decode_images`)."""
from __future__ import annotations

import numpy as np
import triton_python_backend_utils as pb_utils

from ..image_input import decode_images
from ..prompt import ChatPrompt
from ..serving.errors import BadInput
from .io import error_response, load_settings, resolve_checkpoint, scalar, strings


class TritonPythonModel:
    def initialize(self, args):
        (location,) = load_settings(args, "preprocess")
        self.prompt = ChatPrompt(resolve_checkpoint(args, location.checkpoint_path))

    def execute(self, requests):
        return [self._one(r) for r in requests]

    def _one(self, request):
        try:
            question = scalar(pb_utils, request, "text_input", "", str)
            if not question.strip():
                raise BadInput("text_input is empty: ask a question")
            images = decode_images(strings(pb_utils, request, "images"))
            ids = self.prompt.encode(question, len(images))
        except (BadInput, UnicodeDecodeError) as e:
            return error_response(pb_utils, f"preprocess: {e}")
        # The images go on from here rather than from the ensemble's input: that makes the pipeline one
        # chain, and Triton 2.51 crashes when one branch of an ensemble fails while another is in flight.
        return pb_utils.InferenceResponse([
            pb_utils.Tensor("input_ids", np.asarray(ids, dtype=np.int32)),
            pb_utils.Tensor("images_out", np.asarray(images, dtype=np.object_).reshape(-1)),
        ])
