"""`vision_encoder`: ViT + global-budget VisionZip; one vision forward for all requests of an execute().

Not decoupled: an ensemble step may not take inputs from two decoupled models, and moe_decoder
(decoupled) takes this model's outputs together with preprocess's.
"""
from __future__ import annotations

import time

import numpy as np
import torch
import triton_python_backend_utils as pb_utils

from ..serving.device_loss import device_lost, end_process, lost_message
from ..serving.errors import BadInput, internal_error
from ..serving.gpu_turn import TurnHolder, turn_path
from ..serving.load import DEFAULT_PRIORITY, DEGRADABLE, DEGRADED, KeepChooser, check_priority
from ..serving.shared_level import LevelReader, segment_path
from ..settings import resolve_device_dtype
from ..vision import VisionEncoder
from ..visionzip import ImageFeatures, ImageTokens, compress, decoder_inputs
from .io import (Metrics, as_torch, as_triton, error_response, instance_gpu, instance_labels, load_settings,
                 resolve_checkpoint, scalar)


def split_images(pixels: torch.Tensor, sizes: np.ndarray, multiple: int) -> list[torch.Tensor]:
    """Flat CHW pixels of several images (host or GPU) + their (h, w) -> CHW views, checked."""
    sizes = sizes.reshape(-1, 2)
    need = int((3 * sizes[:, 0] * sizes[:, 1]).sum()) if len(sizes) else 0
    if pixels.numel() != need:
        raise BadInput(f"pixel_values has {pixels.numel()} values; image_sizes describe {need}")
    images, start = [], 0
    flat = pixels.reshape(-1)
    for i, (h, w) in enumerate(sizes.tolist()):
        if h <= 0 or w <= 0 or h % multiple or w % multiple:
            raise BadInput(f"image {i}: size {h}x{w} is not a positive multiple of {multiple}")
        images.append(flat[start:start + 3 * h * w].view(3, h, w))
        start += 3 * h * w
    return images


# A lost CUDA context (device_loss.py) ends the stub this long after `execute` returns its answers:
# time for Triton to send them (not checked: a response not yet sent then ends with the server's restart).
LOST_EXIT_DELAY_S = 1.0

# counts name -> (Prometheus metric, help)
METRICS = {
    "requests": ("zipmoe_vision_requests_total", "Requests whose images went through the vision tower"),
    "images": ("zipmoe_vision_images_total", "Images through the vision tower"),
    "forward_us": ("zipmoe_vision_forward_microseconds_total", "Vision tower forward + token importance, summed"),
    "visionzip_us": ("zipmoe_visionzip_microseconds_total", "VisionZip selection and merging, responses built"),
}


class TritonPythonModel:
    def initialize(self, args):
        location, settings, self.visionzip = load_settings(args, "vision_encoder")
        # On a KIND_GPU instance, device auto is the GPU Triton gave it: one tower per listed GPU.
        device, dtype = resolve_device_dtype(settings.device, settings.dtype, instance_gpu(args))
        self.encoder = VisionEncoder(resolve_checkpoint(args, location.checkpoint_path), device, dtype,
                                     settings.importance_layer, settings.budget_weighting,
                                     settings.load_format)
        self.multiple = self.encoder.patch * self.encoder.merge
        self.turn = TurnHolder(turn_path(args["model_repository"], device), settings.gpu_turn_ms)
        self._metric_families = families = Metrics(pb_utils, "vision_encoder", instance_labels(args))
        self.metrics = {name: families.counter(*metric) for name, metric in METRICS.items()}
        self.counts = dict.fromkeys(METRICS, 0)
        # Each request's keep ratio follows moe_decoder's degradation level (serving/load.py).
        vz = self.visionzip
        self.keep = KeepChooser(vz.keep_ratio, vz.keep_ratio_min, LevelReader(segment_path(args["model_repository"])).read)
        self.degraded = families.labelled_counters(*DEGRADED, "priority", DEGRADABLE)

    def execute(self, requests):
        responses: list = [None] * len(requests)
        jobs = []  # (index, images, keep ratio) of the valid requests
        for i, request in enumerate(requests):
            try:
                requested = scalar(pb_utils, request, "visual_keep_ratio", None, float)
                if requested is not None and not 0.0 < requested <= 1.0:
                    raise BadInput(f"visual_keep_ratio must be in (0, 1], got {requested}")
                priority = check_priority(scalar(pb_utils, request, "priority", DEFAULT_PRIORITY, int))
                # dlpack: image_decode's GPU tensor arrives as it is (config: FORCE_CPU_ONLY_INPUT_TENSORS no).
                pixels = as_torch(pb_utils.get_input_tensor_by_name(request, "pixel_values"))
                sizes = pb_utils.get_input_tensor_by_name(request, "image_sizes").as_numpy()
                images = split_images(pixels, sizes, self.multiple)
                jobs.append((i, images, self.keep.choose(requested, priority, len(images))))
            except BadInput as e:
                responses[i] = error_response(pb_utils, f"vision_encoder: {e}")
        if jobs:
            # moe_decoder on this GPU steps aside until the responses are built (text-only: no turn)
            with self.turn.held(any(images for _, images, _ in jobs)):
                self._run(jobs, requests, responses)
        return responses

    def _run(self, jobs, requests, responses) -> None:
        """The valid requests' answers; any error fails the batch's valid requests (one bad batch must not
        take the model down), and a lost CUDA context (device_loss.py) ends the process after them."""
        try:
            self._forward(jobs, requests, responses)
        except Exception as e:
            lost = device_lost(e, self.encoder.device)  # a broken device would fail every later batch
            message = lost_message("vision_encoder", e) if lost else internal_error("vision_encoder", e)
            for i, _, _ in jobs:
                responses[i] = error_response(pb_utils, message)
            if lost:  # once Triton has sent these answers (LOST_EXIT_DELAY_S)
                end_process(pb_utils.Logger.log_error, message, delay_s=LOST_EXIT_DELAY_S)

    def _forward(self, jobs, requests, responses) -> None:
        """One tower forward for the valid requests' images, then VisionZip and the response per request."""
        start_s = time.perf_counter()
        feats = self.encoder.features([im for _, images, _ in jobs for im in images])
        forward_s = time.perf_counter()
        start = 0
        for i, images, ratio in jobs:
            mine = feats[start:start + len(images)]
            start += len(images)
            tokens = compress(mine, ratio, self.visionzip.context_fraction, self.visionzip.min_tokens_per_image)
            wants = set(requests[i].requested_output_names())
            responses[i] = self._response(tokens, ratio,
                                          mine if wants & {"token_importance", "token_keys"} else None)
        self._count(len(jobs), sum(len(images) for _, images, _ in jobs), forward_s - start_s,
                    time.perf_counter() - forward_s)

    def _count(self, requests: int, images: int, forward_s: float, visionzip_s: float) -> None:
        """Where a request's time goes: the tower's forward (shared by the call's requests; it ends with
        the importance's copy to the host, so the GPU work is done) and VisionZip with the response."""
        c = self.counts
        c["requests"] += requests
        c["images"] += images
        c["forward_us"] += int(forward_s * 1e6)
        c["visionzip_us"] += int(visionzip_s * 1e6)
        for name, metric in self.metrics.items():
            metric.sync(c[name])
        for priority, metric in self.degraded.items():
            metric.sync(self.keep.degraded[priority])

    def _response(self, tokens: list[ImageTokens], ratio: float, features: list[ImageFeatures] | None):
        """features: also send every token's importance and key (what mm_qa_bls caches per image)."""
        config = self.encoder.model.config
        arrays = decoder_inputs(tokens, config.out_hidden_size, len(config.deepstack_visual_indexes))
        arrays["visual_keep_ratio_used"] = np.asarray([ratio], np.float32)
        if features is not None:
            arrays["token_importance"] = (torch.cat([f.importance for f in features]).float().numpy()
                                          if features else np.zeros(0, np.float32))
            arrays["token_keys"] = (torch.cat([f.keys for f in features]).float().numpy()
                                    if features else np.zeros((0, 1), np.float32))
        return pb_utils.InferenceResponse([as_triton(pb_utils, name, value) for name, value in arrays.items()])

    def finalize(self):
        self.turn.close()
        self._metric_families.close()
