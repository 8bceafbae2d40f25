"""Helpers shared by the Triton adapters (`models/*.py`): settings, request inputs, metrics, errors.

Only the Triton stub imports `triton_python_backend_utils`; it is passed in here so that the
rest of the package (and the unit tests) never need it.
"""
from __future__ import annotations

import faulthandler
import gc
import json
import threading
from pathlib import Path

import numpy as np
import torch

from ..serving.errors import BadInput
from ..serving.model_settings import MODEL_SETTINGS
from ..settings import parse_parameters


def load_settings(args: dict, model: str) -> tuple:
    """The model's config.pbtxt `parameters`, parsed into the dataclasses that MODEL_SETTINGS[model]
    names (an unknown or malformed parameter fails the load, naming the known ones).

    Every model's initialize() starts here, so this also arms Python's fault handler in the stub: a
    crash in native code (a segfault in a library or in the stub) then writes every Python thread's
    stack to the stub's stderr, which is the server's log; otherwise the stub just vanishes."""
    faulthandler.enable(all_threads=True)
    cfg = json.loads(args["model_config"])
    params = {k: v["string_value"] for k, v in cfg.get("parameters", {}).items()}
    return parse_parameters(params, *MODEL_SETTINGS[model], model=args.get("model_name", model))


def instance_gpu(args: dict) -> int | None:
    """The GPU Triton gave this model instance, or None. With `instance_group [{ kind: KIND_GPU, gpus:
    [0, 1] }]` Triton starts one instance (one stub process) per listed GPU and per `count`, and passes
    each its GPU here; KIND_CPU instances (the shipped configs) get none and keep `device` as written."""
    if args.get("model_instance_kind") == "GPU":
        return int(args["model_instance_device_id"])
    return None


def instance_labels(args: dict) -> dict[str, str]:
    """{"instance": this instance's name, e.g. moe_decoder_0_1} when the model runs several instances, else {}.
    Instances of one model that create a metric of the same labels share it: counters and histograms
    would add up, but gauges (KV blocks, queue, level) overwrite one another and no figure per GPU
    would be left, so with several instances every metric carries the instance (sum() adds them up)."""
    groups = json.loads(args["model_config"]).get("instance_group", [])
    instances = sum(int(g.get("count", 1)) * max(1, len(g.get("gpus", []))) for g in groups)
    return {"instance": args["model_instance_name"]} if instances > 1 else {}


def resolve_checkpoint(args: dict, raw: str) -> Path:
    """`checkpoint_path` from config.pbtxt; a relative path is relative to the repository's parent folder."""
    if not raw:
        raise ValueError("config.pbtxt parameter checkpoint_path is not set")
    path = Path(raw)
    if not path.is_absolute():
        repo_root = Path(args["model_repository"]).resolve().parent
        path = repo_root.parent / path
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"checkpoint_path {path} has no config.json: it must be a Hugging Face checkpoint "
                                f"directory (checkpoints/notes is committed; make checkpoint builds checkpoints/tiny)")
    return path


def get_input(pb_utils, request, name: str) -> np.ndarray | None:
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return None if tensor is None else tensor.as_numpy()


def scalar(pb_utils, request, name: str, default, kind: type):
    """An optional [1]-shaped input as a Python scalar, or `default` when the client left it out."""
    arr = get_input(pb_utils, request, name)
    if arr is None:
        return default
    if arr.size != 1:
        raise BadInput(f"input {name!r} must hold exactly one value, got shape {list(arr.shape)}")
    value = arr.reshape(-1)[0]
    if kind is str:
        return value.decode("utf-8") if isinstance(value, bytes) else str(value)
    return kind(value)


def read_options(pb_utils, request, specs: dict) -> dict:
    """Optional inputs declared in `serving.interface` as Python values, each spec's default where the
    client left one out: lists of bytes for [-1] BYTES inputs, scalars for [1] ones."""
    kinds = {"BYTES": str, "BOOL": bool, "INT32": int, "UINT64": int, "FP32": float}
    return {name: (strings(pb_utils, request, name) or list(spec.default)) if spec.is_list
            else scalar(pb_utils, request, name, spec.default, kinds[spec.dtype]) for name, spec in specs.items()}


def strings(pb_utils, request, name: str) -> list[bytes]:
    """An optional STRING[-1] input as a list of byte strings (empty when absent)."""
    arr = get_input(pb_utils, request, name)
    if arr is None:
        return []
    return [v if isinstance(v, bytes) else str(v).encode("utf-8") for v in arr.reshape(-1)]


class SyncedMetric:
    """A Triton metric fed from a value the model keeps itself: `sync(value)` sends only a change
    (each increment or set is a round trip to the server); counters get the growth, gauges the value.
    After `release()` (the model's finalize) it sends nothing."""

    def __init__(self, metric, counter: bool):
        self.metric, self.counter, self.sent = metric, counter, 0
        self._lock = threading.Lock()  # two threads must not send the same growth twice

    def sync(self, value) -> None:
        with self._lock:
            # Released, unchanged, or a counter's value read before another thread's larger one was sent.
            if self.metric is None or value == self.sent or (self.counter and value < self.sent):
                return
            if self.counter:
                self.metric.increment(value - self.sent)
            else:
                self.metric.set(value)
            self.sent = value

    def release(self) -> None:
        with self._lock:
            self.metric = None


class ObservedHistogram:
    """A Triton histogram: `observe(value)` is one round trip to the server; nothing after `release()`."""

    def __init__(self, metric):
        self.metric = metric
        self._lock = threading.Lock()

    def observe(self, value) -> None:
        with self._lock:
            if self.metric is not None:
                self.metric.observe(value)

    def release(self) -> None:
        with self._lock:
            self.metric = None


class Metrics:
    """Custom metrics of one model, labelled with its name (and its instance, with several). Keeps every
    MetricFamily alive: a Metric is only valid while its family lives. `close()` in the model's
    finalize: a family still alive when the stub process exits is cleared from the stub's destructor,
    which segfaults in server 2.51 (triton-inference-server/server#8662), at every shutdown."""

    def __init__(self, pb_utils, model: str, labels: dict[str, str] | None = None):
        """labels: `instance_labels(args)`, added to every metric's."""
        self._pb = pb_utils
        self._labels = {"model": model, **(labels or {})}
        self._families, self._metrics = [], []

    def _family(self, kind, name: str, description: str):
        family = self._pb.MetricFamily(name=name, description=description, kind=kind)
        self._families.append(family)
        return family

    def _kept(self, metric):
        self._metrics.append(metric)
        return metric

    def _metric(self, kind, name: str, description: str) -> SyncedMetric:
        family = self._family(kind, name, description)
        return self._kept(SyncedMetric(family.Metric(labels=self._labels), kind == self._pb.MetricFamily.COUNTER))

    def counter(self, name: str, description: str) -> SyncedMetric:
        return self._metric(self._pb.MetricFamily.COUNTER, name, description)

    def labelled_counters(self, name: str, description: str, label: str, values) -> dict:
        """One counter family with a metric per value of `label` (besides `model`), each exported from
        the start at 0: value -> SyncedMetric."""
        family = self._family(self._pb.MetricFamily.COUNTER, name, description)
        return {v: self._kept(SyncedMetric(family.Metric(labels={**self._labels, label: str(v)}), True))
                for v in values}

    def gauge(self, name: str, description: str) -> SyncedMetric:
        return self._metric(self._pb.MetricFamily.GAUGE, name, description)

    def histogram(self, name: str, description: str, buckets) -> ObservedHistogram:
        """A histogram (Triton 2.51's Python backend has them)."""
        family = self._family(self._pb.MetricFamily.HISTOGRAM, name, description)
        return self._kept(ObservedHistogram(family.Metric(labels=self._labels, buckets=list(buckets))))

    def close(self) -> None:
        """Drops every metric and family now, while the stub can still clear them (the class docstring);
        the model's own references then send nothing."""
        for metric in self._metrics:
            metric.release()
        self._metrics.clear()
        self._families.clear()
        gc.collect()


def as_triton(pb_utils, name: str, value):
    """A numpy array, or a torch tensor handed over through DLPack where it is (GPU tensors stay on
    the GPU; bf16 has no numpy type)."""
    if isinstance(value, np.ndarray):
        return pb_utils.Tensor(name, value)
    return pb_utils.Tensor.from_dlpack(name, value.contiguous())


def as_torch(tensor) -> torch.Tensor:
    """A Triton input or output tensor as a torch tensor on its device (DLPack: no copy)."""
    return torch.from_dlpack(tensor.to_dlpack())


def error_response(pb_utils, message: str, busy: bool = False):
    """busy (serving.errors.ServerBusy) gets Triton's UNAVAILABLE code, which ensembles keep. No client of
    server 2.51 sees that code (gRPC streams carry only the message; HTTP generate reads the code of an
    error it has already freed, and answered 400 in our tests; BLS responses keep only the message), so
    clients know busy by its phrase, serving.errors.SERVER_BUSY."""
    error = pb_utils.TritonError(message, pb_utils.TritonError.UNAVAILABLE) if busy else pb_utils.TritonError(message)
    return pb_utils.InferenceResponse(output_tensors=[], error=error)
