"""Which dataclasses declare each Python model's config.pbtxt parameters (`settings.py` parses them).

A setting lives beside the code it configures: the engine's in `EngineConfig`, VisionZip's in
`VisionZipConfig` (read by vision_encoder, and by mm_qa_bls from vision_encoder's config.pbtxt),
the services' in `DecoderConfig` and `PipelineConfig`; the two models without a core of their own
declare theirs here.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..checkpoint import LOAD_FORMATS
from ..engine.engine import EngineConfig
from ..settings import DTYPE_CHOICES, CheckpointConfig, setting
from ..visionzip import BUDGET_WEIGHTINGS, VisionZipConfig
from .decoder import DecoderConfig
from .pipeline import PipelineConfig


@dataclass(frozen=True)
class ImageDecodeConfig:
    max_images: int = setting(64, "images per request; also the DALI batch size, allocated and warmed up at load",
                              min=1)
    max_image_pixels: int = setting(40_000_000, "width * height above this is refused from the header", min=1)


@dataclass(frozen=True)
class VisionEncoderConfig:
    load_format: str = setting("auto", "auto: the checkpoint's safetensors; dummy: deterministic random weights of "
                                       "config.json's shapes, made on the device (benchmarks)", choices=LOAD_FORMATS)
    device: str = setting("auto", "cpu, cuda or cuda:N; auto = cuda when a GPU is visible, else cpu")
    dtype: str = setting("auto", "auto = bfloat16 on cuda, float32 on cpu", choices=DTYPE_CHOICES)
    importance_layer: int = setting(-1, "vision layer whose attention ranks the tokens (negative: from the last)")
    budget_weighting: str = setting(
        "distinct", "how a request's images share its budget: distinct (by distinct tokens) or size (by tokens)",
        choices=BUDGET_WEIGHTINGS)


MODEL_SETTINGS = {
    "preprocess": (CheckpointConfig,),
    "postprocess": (CheckpointConfig,),
    "image_decode": (CheckpointConfig, ImageDecodeConfig),
    "vision_encoder": (CheckpointConfig, VisionEncoderConfig, VisionZipConfig),
    "moe_decoder": (CheckpointConfig, DecoderConfig, EngineConfig),
    "mm_qa_bls": (PipelineConfig,),
}
