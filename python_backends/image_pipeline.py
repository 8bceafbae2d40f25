"""The image path of the Qwen-VL processor as one DALI graph: encoded bytes -> RGB -> smart resize ->
bicubic resize -> (x/255 - mean)/std as float CHW.

Shared by the Python model (`models/image_decode.py`, which feeds it per request) and by
`build/dali_model.py` (which serialises it for the native DALI backend). Everything, the
smart-resize arithmetic included, happens inside the graph, so a serialised pipeline needs no
Python at serving time.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import nvidia.dali.fn as fn
import nvidia.dali.math as dmath
import nvidia.dali.types as types
from nvidia.dali import pipeline_def

INPUT_NAME = "images"  # the external_source; the native DALI backend maps the model input by this name


@dataclass(frozen=True)
class ImageConfig:
    """What the pipeline needs from the checkpoint's preprocessor_config.json."""

    factor: int  # patch_size * merge_size: output height and width are multiples of it
    min_pixels: int
    max_pixels: int
    mean: tuple[float, float, float]
    std: tuple[float, float, float]

    @classmethod
    def from_checkpoint(cls, checkpoint: str | Path) -> "ImageConfig":
        cfg = json.loads((Path(checkpoint) / "preprocessor_config.json").read_text())
        size = cfg.get("size", {})
        return cls(  # top-level min/max_pixels override `size`, as in transformers
            factor=int(cfg["patch_size"]) * int(cfg["merge_size"]),
            min_pixels=int(cfg.get("min_pixels", size.get("shortest_edge"))),
            max_pixels=int(cfg.get("max_pixels", size.get("longest_edge"))),
            mean=tuple(float(v) for v in cfg["image_mean"]),
            std=tuple(float(v) for v in cfg["image_std"]),
        )


def _round_half_even_multiple(x, factor: int):
    """round(x / factor) * factor with Python's round (ties to even), in integers: exact for any x."""
    q = x // factor
    r = x - q * factor
    up = (r * 2 > factor) | ((r * 2 == factor) & ((q & 1) == 1))
    return (q + up) * factor


def smart_resize(height, width, factor: int, min_pixels: int, max_pixels: int):
    """transformers' qwen2_vl `smart_resize` on DALI int64 scalars -> (height, width) as float64.

    Same operations in the same order, in float64, so floor/ceil see the same doubles as Python
    (IEEE division and sqrt are correctly rounded) and the integer results agree exactly. Branches
    become masks: DALI graphs have no per-sample `if` without conditionals. transformers' aspect
    ratio > 200 error cannot be raised from a graph; the Python model checks it from the header.
    """
    h_bar = _round_half_even_multiple(height, factor)
    w_bar = _round_half_even_multiple(width, factor)
    h = fn.cast(height, dtype=types.FLOAT64)
    w = fn.cast(width, dtype=types.FLOAT64)
    area = h_bar * w_bar
    too_big = area > max_pixels
    too_small = (area < min_pixels) & (area <= max_pixels)
    keep = (area >= min_pixels) & (area <= max_pixels)
    beta_down = dmath.sqrt(h * w / max_pixels)
    h_down = dmath.max(factor, dmath.floor(h / beta_down / factor) * factor)
    w_down = dmath.max(factor, dmath.floor(w / beta_down / factor) * factor)
    beta_up = dmath.sqrt(min_pixels / (h * w))
    h_up = dmath.ceil(h * beta_up / factor) * factor
    w_up = dmath.ceil(w * beta_up / factor) * factor
    h_out = too_big * h_down + too_small * h_up + keep * fn.cast(h_bar, dtype=types.FLOAT64)
    w_out = too_big * w_down + too_small * w_up + keep * fn.cast(w_bar, dtype=types.FLOAT64)
    return h_out, w_out


@dataclass(frozen=True)
class DecoderOptions:
    """How the mixed (GPU) backend decodes JPEGs; the CPU backend always upsamples chroma like libjpeg.

    fancy_upsampling: interpolate the chroma planes as libjpeg (PIL, the HF processor) does, so GPU
    and CPU decodes agree; without it JPEG colour edges differ by up to ~36 of 255 levels.
    hw_decoder_load: the share of a batch's JPEGs given to the GPU's hardware JPEG decoder, the rest
    to nvJPEG's CUDA decoder (DALI's default is 0.65; 0.9 was twice as fast on an H200)."""
    fancy_upsampling: bool = True
    hw_decoder_load: float = 0.9


def preprocess(encoded, cfg: ImageConfig, decode_device: str, decoder: DecoderOptions = DecoderOptions()):
    """The graph: encoded bytes -> (pixels float32 CHW per image, image_sizes int32 [height, width])."""
    # Sizes come from the header (CPU, no decoding), so they are CPU arguments for resize even
    # when the images themselves are decoded on the GPU.
    shape = fn.peek_image_shape(encoded, dtype=types.INT64)  # HWC
    height, width = smart_resize(shape[0], shape[1], cfg.factor, cfg.min_pixels, cfg.max_pixels)
    # gray/alpha -> RGB, chroma upsampled as `decoder` says (DecoderOptions).
    gpu = {"hw_decoder_load": decoder.hw_decoder_load} if decode_device == "mixed" else {}
    images = fn.decoders.image(encoded, device=decode_device, output_type=types.RGB,
                               jpeg_fancy_upsampling=decoder.fancy_upsampling or decode_device != "mixed", **gpu)
    # Bicubic with antialiasing on downscale, like PIL's BICUBIC that the HF processor uses; the
    # result stays uint8 as in the HF processor (it resizes uint8 images, then rescales).
    images = fn.resize(images, resize_y=fn.cast(height, dtype=types.FLOAT), resize_x=fn.cast(width, dtype=types.FLOAT),
                       interp_type=types.INTERP_CUBIC, antialias=True)
    pixels = fn.crop_mirror_normalize(
        images, dtype=types.FLOAT, output_layout="CHW",
        mean=[255.0 * m for m in cfg.mean], std=[255.0 * s for s in cfg.std],
    )
    sizes = fn.cast(fn.stack(height, width), dtype=types.INT32)
    return pixels, sizes


def image_pipeline(cfg: ImageConfig, *, batch_size: int, num_threads: int, device_id: int | None, gpu: bool,
                   padded_rows: bool = False, decoder: DecoderOptions = DecoderOptions()):
    """The pipeline, fed through external_source INPUT_NAME, one feed per run (prefetch_queue_depth=1).

    gpu: `mixed` decoding (nvJPEG / hardware decoder) and GPU resize; needs a device_id to run, but
    serialises without one (the DALI backend supplies its instance's device). gpu=False: CPU
    operators only, which DALI runs with device_id=None.
    padded_rows=False: pixel_values is one CHW tensor per image (the Python model concatenates).
    padded_rows=True: each image flattened and zero-padded to the longest of the batch: the native
    DALI backend returns every output as one dense [batch, ...] tensor.
    """

    @pipeline_def(batch_size=batch_size, num_threads=num_threads, device_id=device_id, prefetch_queue_depth=1)
    def pipe():
        encoded = fn.external_source(name=INPUT_NAME, dtype=types.UINT8, device="cpu")
        pixels, sizes = preprocess(encoded, cfg, "mixed" if gpu else "cpu", decoder)
        if padded_rows:
            pixels = fn.pad(fn.reshape(pixels, shape=[-1]), fill_value=0.0)
        return pixels, sizes

    return pipe()


def header_pipeline(*, batch_size: int, num_threads: int):
    """(height, width, channels) from each image's header, without decoding: the guard that runs
    before the image pipeline. It uses nvImageCodec's own parsers, the ones the decoder will use,
    so the check and the decode agree on every format DALI reads."""

    @pipeline_def(batch_size=batch_size, num_threads=num_threads, device_id=None, prefetch_queue_depth=1)
    def pipe():
        return fn.peek_image_shape(fn.external_source(name=INPUT_NAME, dtype=types.UINT8), dtype=types.INT64)

    return pipe()
