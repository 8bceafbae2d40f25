"""`image_decode`: encoded images [N] -> Qwen-VL pixel values through DALI (`image_pipeline`).

The images come as the client sent them (file bytes over gRPC, base64 text over HTTP generate,
data URLs: `image_input.decode_images`); in mm_qa straight from the ensemble's input, after
preprocess (whose image count arrives as `expected_images`).

Per request: the count and empty-image checks; a header pass (a JPEG's frame header read directly,
other formats through DALI's peek_image_shape, CPU, no decoding) that refuses an image whose header
announces more than max_image_pixels before anything that large is allocated; then the image
pipeline decodes, smart-resizes, resizes and normalises the whole request as one DALI batch. Errors name the image and never take the model down.
Where a request's time goes is exported as counters (PHASES): reading the input, the checks with
the header pass, the DALI run, and the copy into the output buffer; Triton's compute time minus
their sum is handing the response over.
"""
from __future__ import annotations

import ctypes
import io
import os
import re
import time

import numpy as np
import torch
import triton_python_backend_utils as pb_utils
from PIL import Image

from ..image_input import decode_images
from ..image_pipeline import INPUT_NAME, DecoderOptions, ImageConfig, header_pipeline, image_pipeline
from ..jpeg_header import jpeg_size, truncated_jpeg
from ..serving.errors import BadInput
from ..settings import resolve_device
from .io import Metrics, error_response, instance_gpu, instance_labels, load_settings, resolve_checkpoint, scalar, strings

MAX_ASPECT_RATIO = 200  # transformers' smart_resize refuses longer/shorter above this
# phase -> (Prometheus counter of microseconds, help); requests counted beside them
PHASES = {
    "input": ("zipmoe_image_decode_input_microseconds_total", "Reading the encoded images from the request"),
    "check": ("zipmoe_image_decode_check_microseconds_total", "Count, truncation and header checks"),
    "pipeline": ("zipmoe_image_decode_pipeline_microseconds_total", "The DALI run: decode, resize, normalise"),
    "output": ("zipmoe_image_decode_output_microseconds_total",
               "Building the outputs: the pixels copied into their buffer (sizes alone: DALI's GPU work awaited)"),
}
REQUESTS = ("zipmoe_image_decode_requests_total", "Requests decoded (the phases' denominator)")


def _dali_reason(error: Exception) -> str:
    """The useful line of a DALI pipeline error (the rest is our own pipeline's traceback)."""
    m = re.search(r"encountered:\s*(.*?)\s*(?:Current pipeline object|$)", str(error), re.S)
    reason = re.sub(r"Failed to decode sample #\d+\s*:?", "", m.group(1) if m else str(error))
    return " ".join(reason.split())


class _Pipe:
    """A DALI pipeline fed one request at a time.

    A pipeline that raised is no longer valid (DALI says so, and refuses the next run), so it is
    rebuilt. DALI's error does not reliably say which sample failed; to name it, the images are
    then run one at a time. Building a CPU pipeline takes milliseconds, and this is the error path.
    """

    def __init__(self, make, failure: str):
        self._make, self._failure = make, failure
        self._pipe = self._build()

    def _build(self):
        pipe = self._make()
        pipe.build()
        return pipe

    def _run(self, images):
        self._pipe.feed_input(INPUT_NAME, images)
        return self._pipe.run()

    def run(self, images: list[np.ndarray], numbers: list[int] | None = None):
        """numbers: each image's number in the request, for errors (default: its place in `images`)."""
        try:
            return self._run(images)
        except RuntimeError as batch_error:
            self._pipe = self._build()
            error = batch_error
        for i, image in zip(numbers or range(len(images)), images):
            try:
                self._run([image])
            except RuntimeError as e:
                self._pipe = self._build()
                detail = _dali_reason(e)
                raise BadInput(f"image {i}: cannot decode: {self._failure}" + (f" ({detail})" if detail else ""))
        raise RuntimeError(f"DALI failed on the batch but on no single image: {_dali_reason(error)}")


def _warmup_images(count: int) -> list[np.ndarray]:
    """`count` 1024x768 JPEGs (the typical photo) and one small PNG: the shapes and decoders of real traffic."""
    y, x = np.mgrid[0:768, 0:1024]
    rgb = np.stack([x % 256, y % 256, (x + y) % 256], -1).astype(np.uint8)
    encoded = []
    for fmt, array in (("JPEG", rgb), ("PNG", rgb[:100, :150])):
        buf = io.BytesIO()
        Image.fromarray(array).save(buf, fmt)
        encoded.append(np.frombuffer(buf.getvalue(), np.uint8))
    return [encoded[0]] * (count - 1) + [encoded[1]]


class TritonPythonModel:
    def initialize(self, args):
        location, settings = load_settings(args, "image_decode")
        checkpoint = resolve_checkpoint(args, location.checkpoint_path)
        cfg = ImageConfig.from_checkpoint(checkpoint)
        self.max_images, self.max_image_pixels = settings.max_images, settings.max_image_pixels
        # Mixed decoding (nvJPEG / hardware decoder) and GPU resize on a GPU: under KIND_GPU the instance's
        # (one decoder per listed GPU). device_id None (no GPU): DALI's CPU-only mode, CPU operators only.
        self.device = torch.device(resolve_device("auto", instance_gpu(args)))
        if self.device == torch.device("cuda"):  # KIND_CPU on a GPU host: the current GPU, by number for DALI
            self.device = torch.device("cuda", torch.cuda.current_device())
        device_id = self.device.index
        threads = min(8, os.cpu_count() or 1)
        self.header = _Pipe(lambda: header_pipeline(batch_size=self.max_images, num_threads=threads),
                            "not a supported image, or its header is corrupt")
        decoder = DecoderOptions(settings.jpeg_fancy_upsampling, settings.hw_decoder_load)
        self.image = _Pipe(lambda: image_pipeline(cfg, batch_size=self.max_images, num_threads=threads,
                                                  device_id=device_id, gpu=device_id is not None, decoder=decoder),
                           "the image data is corrupt or truncated")
        # The first run of a batch allocates DALI's buffers (on GPU, the first requests of a new
        # shape take up to 1 s): pay that at load, with a full batch.
        families = Metrics(pb_utils, "image_decode", instance_labels(args))
        self._metrics = {phase: families.counter(*metric) for phase, metric in PHASES.items()}
        self._metrics["requests"] = families.counter(*REQUESTS)
        self._metric_families, self._counts = families, dict.fromkeys(self._metrics, 0)
        warm = _warmup_images(self.max_images)
        self.header.run(warm)
        self.image.run(warm)
        pb_utils.Logger.log_info(
            f"image_decode: {checkpoint.name} on {self.device}, {threads} DALI threads, factor {cfg.factor}, "
            f"pixels [{cfg.min_pixels}, {cfg.max_pixels}], at most {self.max_images} images")

    def execute(self, requests):
        return [self._one(r) for r in requests]

    def _one(self, request):
        times = [time.perf_counter()]  # the start, then the end of each of PHASES in order
        try:
            images = [np.frombuffer(data, np.uint8) for data in decode_images(strings(pb_utils, request, "images"))]
            times.append(time.perf_counter())
            self._check(images, scalar(pb_utils, request, "expected_images", None, int))
            times.append(time.perf_counter())
            pixels, image_sizes = self._run(images)
            times.append(time.perf_counter())
            # Only what was asked for: a caller that wants the sizes alone (a client checking its
            # images) would otherwise have every pixel copied into a buffer it never reads (64
            # photos on an H200: 604 MB, and 10.8 ms of the request's compute time after execute,
            # about what a copy to the host takes).
            outputs = [pb_utils.Tensor("image_sizes", image_sizes)]
            if "pixel_values" in request.requested_output_names():
                outputs.insert(0, pb_utils.Tensor.from_dlpack("pixel_values", self._pixel_values(pixels)))
            elif self.device.type == "cuda":  # DALI's GPU work done, as the pixel copy would wait for it
                torch.cuda.synchronize(self.device)
            times.append(time.perf_counter())
        except BadInput as e:
            return error_response(pb_utils, f"image_decode: {e}")
        self._count(times)
        return pb_utils.InferenceResponse(outputs)

    def _check(self, images: list[np.ndarray], expected: int | None) -> None:
        """expected: how many images the prompt has places for (mm_qa), or None."""
        if expected is not None and expected != len(images):
            raise BadInput(f"{len(images)} images, but the prompt has places for {expected}")
        if len(images) > self.max_images:
            raise BadInput(f"{len(images)} images; this deployment accepts at most {self.max_images}")
        for i, image in enumerate(images):
            if not image.size:
                raise BadInput(f"image {i}: empty")
            if truncated_jpeg(image):
                raise BadInput(f"image {i}: cannot decode: the image data is corrupt or truncated (a JPEG without its end)")
        if not images:
            return
        # JPEGs (nearly all traffic) by their frame header, read here in microseconds; the rest through
        # DALI's header pass (nvImageCodec's parsers), one batch, which costs milliseconds whatever its size.
        sizes = [jpeg_size(image) for image in images]
        others = [i for i, size in enumerate(sizes) if size is None]
        if others:
            shapes = self.header.run([images[i] for i in others], others)[0].as_array()
            for i, (height, width, _) in zip(others, shapes.tolist()):
                sizes[i] = (height, width)
        for i, (height, width) in enumerate(sizes):
            if height * width > self.max_image_pixels:
                raise BadInput(f"image {i}: {width}x{height} = {height * width} pixels is more than "
                               f"max_image_pixels {self.max_image_pixels}")
            if min(height, width) == 0 or max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
                raise BadInput(f"image {i}: {width}x{height}: aspect ratio above {MAX_ASPECT_RATIO}:1")

    def _count(self, times: list[float]) -> None:
        """times: perf_counter at the start and after each phase, in PHASES' order."""
        c = self._counts
        c["requests"] += 1
        for phase, start, end in zip(PHASES, times, times[1:]):
            c[phase] += int((end - start) * 1e6)
        for name, metric in self._metrics.items():
            metric.sync(c[name])

    def _run(self, images: list[np.ndarray]):
        """The image pipeline over the request: (DALI's pixels, None without images; image_sizes
        [N, 2] (h, w))."""
        if not images:
            return None, np.zeros((0, 2), np.int32)
        pixels, sizes = self.image.run(images)
        return pixels, sizes.as_array()

    def _pixel_values(self, pixels) -> torch.Tensor:
        """Every image's CHW values, concatenated, on the model's device (on GPU handed to Triton
        through DLPack, never copied to the host)."""
        # A fresh buffer per request: DALI reuses its output memory on the next run, which comes
        # before Triton has sent this response when a call carries several requests.
        size = sum(int(np.prod(s)) for s in pixels.shape()) if pixels is not None else 0
        out = torch.empty(size, dtype=torch.float32, device=self.device)
        if out.numel():
            dst = ctypes.c_void_p(out.data_ptr())
            if self.device.type == "cuda":  # every sample back to back; waits for the copy
                stream = ctypes.c_void_p(torch.cuda.current_stream(self.device).cuda_stream)
                pixels.copy_to_external(dst, stream)
            else:
                pixels.copy_to_external(dst)
        return out

    def finalize(self):
        # Tear the pipelines (their worker threads and GPU buffers) down while CUDA is still up: left
        # to interpreter exit, the GPU variant kept the model from unloading at server shutdown. The
        # metrics' close() collects them with the metric families.
        self.header = self.image = None
        self._metric_families.close()
