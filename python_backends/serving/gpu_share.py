"""How a helper model's process shares the GPU with moe_decoder under CUDA MPS.

image_decode and vision_encoder run in their own Triton stub processes, each with its own CUDA
context. Without MPS the GPU time-slices between contexts; with MPS (`nvidia-cuda-mps-control -d`
before tritonserver starts) their kernels run side by side, and two client settings decide who
yields: CUDA_MPS_CLIENT_PRIORITY (1 = below normal: the MPS scheduler prefers the other clients'
work) and CUDA_MPS_ACTIVE_THREAD_PERCENTAGE (a cap on the share of SMs this client's kernels use).
Both are read when the process's CUDA driver initialises, so `apply` must run before anything in the
process touches CUDA: first thing in the model's initialize(). It checks that this held (the
driver answers cuDeviceGetCount with CUDA_ERROR_NOT_INITIALIZED until cuInit) and says so otherwise.
Without an MPS daemon both variables are ignored by the driver.
"""
from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass

from ..settings import setting

PRIORITIES = {"normal": "0", "below_normal": "1"}
CUDA_ERROR_NOT_INITIALIZED = 3


@dataclass(frozen=True)
class GpuShareConfig:
    mps_client_priority: str = setting(
        "below_normal", "under CUDA MPS: this model's kernels yield to moe_decoder's (below_normal) or "
                        "compete as equals (normal); no effect without an MPS daemon", choices=tuple(PRIORITIES))
    mps_active_thread_percentage: int = setting(
        0, "under CUDA MPS: the most SMs, in percent, this model's kernels occupy (0: no cap); no effect "
           "without an MPS daemon", min=0, max=100)


def _driver_initialised() -> bool | None:
    """Whether this process's CUDA driver has already been initialised; None without a CUDA driver."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    count = ctypes.c_int(0)
    return cuda.cuDeviceGetCount(ctypes.byref(count)) != CUDA_ERROR_NOT_INITIALIZED


def mps_environment(config: GpuShareConfig) -> dict[str, str]:
    """The CUDA_MPS_* variables that `config` asks for."""
    env = {"CUDA_MPS_CLIENT_PRIORITY": PRIORITIES[config.mps_client_priority]}
    if config.mps_active_thread_percentage:
        env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(config.mps_active_thread_percentage)
    return env


def apply(config: GpuShareConfig, initialised=_driver_initialised) -> str | None:
    """Sets this process's MPS client variables; returns a warning when CUDA was already initialised
    (they may then not apply), None otherwise. An operator's own CUDA_MPS_* environment is kept."""
    wanted = {k: v for k, v in mps_environment(config).items() if k not in os.environ}
    os.environ.update(wanted)
    if wanted and initialised():
        return (f"CUDA was initialised in this process before {', '.join(sorted(wanted))} could be set: "
                "under MPS they may not apply")
    return None
