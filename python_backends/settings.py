"""Settings: each one declared once, as a field of a config dataclass, and read from there.

A Triton model's `parameters` in config.pbtxt arrive as strings; `parse_parameters` turns them
into the dataclasses that declare them (type, default, allowed range or choices, help), and
refuses a parameter no dataclass declares, or a value that does not parse, naming the known
ones. Fields are declared with `setting(...)`; the dataclass's default is the only default.
"""
from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass

# Parameters the Python backend itself reads from config.pbtxt (not ours to declare).
BACKEND_PARAMETERS = frozenset({"FORCE_CPU_ONLY_INPUT_TENSORS", "EXECUTION_ENV_PATH"})


class SettingsError(ValueError):
    """A config.pbtxt parameter that is unknown or malformed: the model refuses to load."""


def setting(default, help: str, *, min=None, max=None, choices=None):
    """A dataclass field that is also a config.pbtxt parameter of the same name."""
    return dataclasses.field(default=default, metadata={"help": help, "min": min, "max": max, "choices": choices})


def _parse_value(kind: type, text: str):
    if kind is bool:
        if text.lower() not in ("true", "false"):
            raise ValueError("must be true or false")
        return text.lower() == "true"
    value = kind(text)
    if kind is float and not math.isfinite(value):
        raise ValueError("must be a finite number")
    return value


def _check(field: dataclasses.Field, value) -> None:
    meta = field.metadata
    if meta.get("choices") is not None and value not in meta["choices"]:
        raise ValueError(f"must be one of {', '.join(map(str, meta['choices']))}")
    if meta.get("min") is not None and value < meta["min"]:
        raise ValueError(f"must be >= {meta['min']}")
    if meta.get("max") is not None and value > meta["max"]:
        raise ValueError(f"must be <= {meta['max']}")


def check_fields(config) -> None:
    """Range and choice checks of a config built in code rather than parsed (ValueError)."""
    for name, (field, _) in settings_of(type(config)).items():
        try:
            _check(field, getattr(config, name))
        except ValueError as e:
            raise ValueError(f"{name}={getattr(config, name)!r} {e}") from None


def settings_of(cls) -> dict[str, tuple[dataclasses.Field, type]]:
    """name -> (field, type) of every setting a config dataclass declares."""
    hints = typing.get_type_hints(cls)
    return {f.name: (f, hints[f.name]) for f in dataclasses.fields(cls) if "help" in f.metadata}


def parse_parameters(params: dict[str, str], *classes, model: str = "model") -> tuple:
    """config.pbtxt parameters -> one instance of each class (in order), each field from the
    parameter of its name, or its default. Unknown names and bad values raise SettingsError."""
    declared = {}
    for cls in classes:
        for name, spec in settings_of(cls).items():
            if name in declared:  # one parameter must mean one setting
                raise TypeError(f"{name} is declared by both {declared[name][0].__name__} and {cls.__name__}")
            declared[name] = (cls, *spec)
    unknown = sorted(set(params) - set(declared) - BACKEND_PARAMETERS)
    if unknown:
        raise SettingsError(f"{model}/config.pbtxt: unknown parameter(s) {', '.join(unknown)}; "
                            f"known: {', '.join(sorted(declared))}")
    values: dict[type, dict] = {cls: {} for cls in classes}
    for name, text in params.items():
        if name in BACKEND_PARAMETERS:
            continue
        cls, field, kind = declared[name]
        try:
            value = _parse_value(kind, text.strip())
            _check(field, value)
        except ValueError as e:
            detail = str(e) if str(e).startswith("must") else f"is not a valid {kind.__name__}"
            raise SettingsError(f"{model}/config.pbtxt: parameter {name}={text!r} {detail}") from None
        values[cls][name] = value
    return tuple(cls(**values[cls]) for cls in classes)


@dataclass(frozen=True)
class CheckpointConfig:
    """Every model reads its part of the same Hugging Face directory."""
    checkpoint_path: str = setting(
        "", "local Hugging Face directory; relative to the folder holding model_repository/")


DTYPE_NAMES = ("float32", "bfloat16", "float16")
DTYPE_CHOICES = ("auto", *DTYPE_NAMES)
LOAD_FORMATS = ("auto", "dummy")


def dtypes() -> dict:
    """DTYPE_NAMES -> torch dtypes."""
    import torch

    return {name: getattr(torch, name) for name in DTYPE_NAMES}


# Settings of both models that run on a device (moe_decoder's EngineConfig, vision_encoder's config).
def device_setting():
    return setting("auto", "cpu, cuda or cuda:N; auto = cuda when a GPU is visible, else cpu; on an instance of "
                           "kind KIND_GPU, auto and cuda mean the instance's GPU")


def dtype_setting():
    return setting("auto", "weights and activations; auto = bfloat16 on cuda, float32 on cpu", choices=DTYPE_CHOICES)


def load_format_setting():
    return setting("auto", "auto: the checkpoint's safetensors; dummy: deterministic random weights of "
                           "config.json's shapes, made on the device (benchmarks)", choices=LOAD_FORMATS)


def resolve_device(device: str, gpu: int | None = None) -> str:
    """A device setting -> the device a model runs on. auto = cuda when a GPU is visible, else cpu.
    gpu: the GPU Triton gave this model instance (instance_group kind KIND_GPU: one instance per listed
    GPU), which `auto` and a bare `cuda` then mean; so one config.pbtxt places an engine on every GPU.
    cuda:N and cpu stay as the operator wrote them."""
    import torch

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and gpu is not None:
        device = f"cuda:{gpu}"
    return device


def resolve_device_dtype(device: str, dtype: str, gpu: int | None = None):
    """(torch.device, torch.dtype) of `resolve_device`; dtype auto = bfloat16 on cuda, float32 on cpu."""
    import torch

    device = resolve_device(device, gpu)
    if dtype == "auto":
        dtype = "bfloat16" if device.startswith("cuda") else "float32"
    return torch.device(device), dtypes()[dtype]


def make_current(device) -> None:
    """Makes cuda:N the calling thread's current CUDA device (nothing for cpu or a bare cuda). The
    current device is per host thread, and what follows it rather than the tensors' device (Triton
    kernel launches, CUDA-graph capture, torch.cuda.current_stream() and synchronize() without an
    argument) would otherwise go to GPU 0: every thread that runs a model on cuda:N calls this."""
    import torch

    device = torch.device(device)
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)
