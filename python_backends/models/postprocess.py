"""`postprocess`: a response's token window + byte range -> its text delta (stateless; see detokenize.py)."""
from __future__ import annotations

import numpy as np
import triton_python_backend_utils as pb_utils

from ..detokenize import TokenBytes, window_text
from .io import load_settings, resolve_checkpoint


class TritonPythonModel:
    def initialize(self, args):
        (location,) = load_settings(args, "postprocess")
        self.token_bytes = TokenBytes.from_tokenizer_json(resolve_checkpoint(args, location.checkpoint_path))

    def execute(self, requests):
        responses = []
        for request in requests:
            ids = pb_utils.get_input_tensor_by_name(request, "output_ids").as_numpy().reshape(-1).tolist()
            begin, end = pb_utils.get_input_tensor_by_name(request, "text_range").as_numpy().reshape(-1).tolist()
            text = window_text(self.token_bytes, ids, begin, end)
            out = pb_utils.Tensor("text_output", np.asarray([text.encode("utf-8")], dtype=np.object_))
            responses.append(pb_utils.InferenceResponse([out]))
        return responses
