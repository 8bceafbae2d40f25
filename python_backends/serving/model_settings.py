"""Which dataclasses declare each Python model's config.pbtxt parameters (`settings.py` parses them).

A setting lives beside the code it configures: the engine's in `EngineConfig`, VisionZip's in
`VisionZipConfig` (read by vision_encoder, and by mm_qa_bls from vision_encoder's config.pbtxt; the
load-adaptive keep range too), the services' in `DecoderConfig` and `PipelineConfig`, the load
controller's in `DegradationConfig` (moe_decoder); the two models without a core of their own
declare theirs here.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..engine.engine import EngineConfig
from ..settings import CheckpointConfig, device_setting, dtype_setting, load_format_setting, setting
from ..visionzip import BUDGET_WEIGHTINGS, VisionZipConfig
from .decoder import DecoderConfig
from .load import DegradationConfig
from .pipeline import PipelineConfig


@dataclass(frozen=True)
class ImageDecodeConfig:
    max_images: int = setting(64, "images per request; also the DALI batch size, allocated and warmed up at load",
                              min=1)
    max_image_pixels: int = setting(40_000_000, "width * height above this is refused from the header", min=1)
    jpeg_fancy_upsampling: bool = setting(True, "GPU decoding: upsample JPEG chroma as libjpeg (PIL, the HF processor) "
                                                "does; false is faster, colour edges differ by up to ~36 of 255 levels")
    hw_decoder_load: float = setting(0.9, "GPU decoding: share of a request's JPEGs given to the hardware JPEG "
                                           "decoder, the rest to nvJPEG's CUDA decoder", min=0.0, max=1.0)


@dataclass(frozen=True)
class VisionEncoderConfig:
    load_format: str = load_format_setting()
    device: str = device_setting()
    dtype: str = dtype_setting()
    importance_layer: int = setting(-1, "vision layer whose attention ranks the tokens (negative: from the last)")
    budget_weighting: str = setting(
        "distinct", "how a request's images share its budget: distinct (by distinct tokens) or size (by tokens)",
        choices=BUDGET_WEIGHTINGS)
    gpu_turn_ms: float = setting(
        250.0, "on a GPU: moe_decoder on the same GPU launches no step while the tower works on a batch, for at most "
             "this long (serving/gpu_turn.py); 0: the two share the GPU as the driver time-slices them", min=0.0)


MODEL_SETTINGS = {
    "preprocess": (CheckpointConfig,),
    "postprocess": (CheckpointConfig,),
    "image_decode": (CheckpointConfig, ImageDecodeConfig),
    "vision_encoder": (CheckpointConfig, VisionEncoderConfig, VisionZipConfig),
    "moe_decoder": (CheckpointConfig, DecoderConfig, DegradationConfig, EngineConfig),
    "mm_qa_bls": (PipelineConfig,),
}
