"""`preprocess`: question (+ images) -> prompt token ids through the checkpoint's chat template."""
from __future__ import annotations

import numpy as np
import triton_python_backend_utils as pb_utils

from ..prompt import ChatPrompt
from .io import BadInput, error_response, model_parameters, resolve_checkpoint, scalar, strings


class TritonPythonModel:
    def initialize(self, args):
        params = model_parameters(args)
        self.prompt = ChatPrompt(resolve_checkpoint(args, params))

    def execute(self, requests):
        return [self._one(r) for r in requests]

    def _one(self, request):
        try:
            question = scalar(pb_utils, request, "text_input", "", str)
            if not question.strip():
                raise BadInput("text_input is empty: ask a question")
            if strings(pb_utils, request, "images"):
                raise BadInput("this deployment does not take images yet (the image path is not wired)")
            ids = self.prompt.encode(question)
        except (BadInput, UnicodeDecodeError) as e:
            return error_response(pb_utils, f"preprocess: {e}")
        return pb_utils.InferenceResponse([pb_utils.Tensor("input_ids", np.asarray(ids, dtype=np.int32))])
