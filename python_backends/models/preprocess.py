"""`preprocess`: question (+ images) -> prompt token ids through the checkpoint's chat template.

It reads only how many images came (one placeholder each) and hands that count on: in mm_qa,
image_decode takes the images from the ensemble's input and the count from here, so the images'
bytes never pass through this model and the ensemble stays one chain (preprocess, then
image_decode)."""
from __future__ import annotations

import numpy as np
import triton_python_backend_utils as pb_utils

from ..prompt import ChatPrompt
from ..serving.errors import BadInput
from .io import error_response, load_settings, resolve_checkpoint, scalar


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
            images = pb_utils.get_input_tensor_by_name(request, "images")
            count = 0 if images is None else int(np.prod(images.shape()))  # the shape alone: no bytes read
            ids = self.prompt.encode(question, count)
        except (BadInput, UnicodeDecodeError) as e:
            return error_response(pb_utils, f"preprocess: {e}")
        return pb_utils.InferenceResponse([
            pb_utils.Tensor("input_ids", np.asarray(ids, dtype=np.int32)),
            pb_utils.Tensor("image_count", np.asarray([count], dtype=np.int32)),
        ])
