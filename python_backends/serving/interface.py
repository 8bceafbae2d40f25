"""The tensors that cross Triton boundaries, declared once.

`CLIENT_INPUTS` / `CLIENT_OUTPUTS` are the interface of `mm_qa` and `mm_qa_bls` (what a client
sends and gets back). The client (`clients/triton_client.py`) is built from them, the adapters
read requests with them, and `tests/test_interface.py` checks every model's config.pbtxt against
them. `DECODER_OPTIONS` are the client inputs that reach moe_decoder unchanged (the ensemble maps
them, mm_qa_bls forwards them); `VISUAL_TOKENS` is what vision_encoder hands moe_decoder per
request, and `KEEP_RATIO_USED` goes with it (docs/ARCHITECTURE.md has the whole table, producers
and consumers).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .load import DEFAULT_PRIORITY, MAX_PRIORITY

# Triton's datatype names (what clients and the HTTP/JSON protocol use) -> numpy dtype.
NUMPY = {"BYTES": np.object_, "BOOL": np.bool_, "INT32": np.int32, "UINT64": np.uint64, "FP32": np.float32}


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str  # Triton datatype name (BYTES, INT32, FP32, BOOL, UINT64)
    dims: tuple[int, ...]  # -1: any size
    optional: bool = False
    default: object = None  # used when the client leaves it out; None: the server's configured value
    doc: str = ""

    @property
    def numpy_dtype(self):
        return NUMPY[self.dtype]

    @property
    def config_type(self) -> str:
        """The data_type config.pbtxt writes (TYPE_STRING for BYTES)."""
        return "TYPE_STRING" if self.dtype == "BYTES" else f"TYPE_{self.dtype}"

    @property
    def is_list(self) -> bool:
        return self.dims == (-1,)


def _specs(*specs: TensorSpec) -> dict[str, TensorSpec]:
    return {s.name: s for s in specs}


DECODER_OPTIONS = _specs(
    TensorSpec("max_tokens", "INT32", (1,), True, None, "tokens to generate at most (server: default_max_tokens)"),
    TensorSpec("stream", "BOOL", (1,), True, False, "one response per token instead of one at the end"),
    TensorSpec("temperature", "FP32", (1,), True, 0.0, "0 = greedy"),
    TensorSpec("top_p", "FP32", (1,), True, 1.0, "nucleus sampling, in (0, 1]"),
    TensorSpec("top_k", "INT32", (1,), True, 0, "sample among the k most likely tokens; 0 = off"),
    TensorSpec("random_seed", "UINT64", (1,), True, None, "seed of this request's sampling"),
    TensorSpec("stop_words", "BYTES", (-1,), True, (), "the answer ends before the first of these strings"),
    TensorSpec("ignore_eos", "BOOL", (1,), True, False, "generate exactly max_tokens (benchmarks)"),
    TensorSpec("sere", "BOOL", (1,), True, True,
               "false: this request's tokens keep their top-K experts (they still count as primaries for others)"),
)

CLIENT_INPUTS = _specs(
    # Declared optional so that a request without it reaches preprocess / mm_qa_bls, which refuse it
    # ("text_input is empty: ask a question"); server 2.51 checks only how many inputs came.
    TensorSpec("text_input", "BYTES", (1,), True, None, "the question (required)"),
    TensorSpec("images", "BYTES", (-1,), True, (), "encoded images (JPEG, PNG, ...), in the order the question names them"),
    *DECODER_OPTIONS.values(),
    TensorSpec("visual_keep_ratio", "FP32", (1,), True, None,
               "fraction of the request's visual tokens kept, in (0, 1] (server: keep_ratio); under load "
               "a request of priority >= 1 may get less"),
    TensorSpec("priority", "INT32", (1,), True, DEFAULT_PRIORITY,
               f"0: the keep ratio is never lowered under load; 1 .. {MAX_PRIORITY}: lowered, higher numbers first"),
)

# The keep ratio VisionZip used: vision_encoder (mm_qa) or mm_qa_bls -> moe_decoder, which echoes it.
KEEP_RATIO_USED = TensorSpec("visual_keep_ratio_used", "FP32", (1,), True,
                             doc="the keep ratio VisionZip used for this request (the one its images would have "
                                 "had when it has none)")

CLIENT_OUTPUTS = _specs(
    TensorSpec("text_output", "BYTES", (1,), doc="the text delta when streaming, else the whole answer"),
    TensorSpec("input_token_count", "INT32", (1,), doc="prompt tokens, kept visual tokens included"),
    TensorSpec("output_token_count", "INT32", (1,), doc="tokens generated so far"),
    TensorSpec("finish_reason", "BYTES", (1,), doc="eos, length or stop; empty until the last response (a cancelled request ends without one)"),
    TensorSpec("visual_tokens_kept", "INT32", (-1,), doc="visual tokens kept per image"),
    TensorSpec(KEEP_RATIO_USED.name, "FP32", (1,), doc=KEEP_RATIO_USED.doc),
)

VISUAL_TOKENS = _specs(
    TensorSpec("visual_embeds", "BF16", (-1, -1), True, doc="kept tokens of all images [V, hidden] (stay on the GPU)"),
    TensorSpec("deepstack_embeds", "BF16", (-1, -1, -1), True,
               doc="their DeepStack features [layers, V, hidden] (stay on the GPU)"),
    TensorSpec("visual_positions", "INT32", (-1, 2), True, doc="(row, col) of each kept token in its merged grid"),
    TensorSpec("image_grids", "INT32", (-1, 2), True, doc="merged grid (rows, cols) of each image"),
    TensorSpec("visual_tokens_kept", "INT32", (-1,), True, doc="tokens kept per image"),
)
