"""Programmatic dependent launch (PDL, Hopper and later) for the decode step's kernels.

A batch-1 decode step is about ten launches a layer, most of them a few microseconds long, and
in a CUDA graph each still starts only after the one before has finished and flushed: the
launch, the ramp-up of its first wave and the drain of the last are paid every time, while HBM
sits idle. With PDL a kernel is launched while the one before is still running; its programs
first do what needs nothing from earlier kernels (an L2 prefetch of their share of a weight
matrix, `prefetch_l2`), then wait in `wait_for_inputs` until every earlier kernel has finished
and its writes are visible, and let the next kernel launch in turn.

The rule every kernel here keeps: before `wait_for_inputs` it reads only weights (never
written during a step) and writes nothing. Each kernel waits in every program, so waiting on
the kernel just before is waiting on all of them. A launch without the flag (cuBLAS, PyTorch's
own kernels) is ordered as usual, and a kernel with it that follows one simply starts when that
one ends.

`launch_options(device)` gives a Triton launch its keywords: the kernel's `PDL` constexpr and
Triton's `launch_pdl`, and for a kernel that prefetches (`prefetch=True`) its `PREFETCH`
constexpr. Off without CUDA (the interpreter), before compute capability 9.0, and where
ZIPMOE_PDL=0 (ZIPMOE_PDL=noprefetch: chained, nothing prefetched); `set_enabled` switches both in
a running process (the benchmarks compare them in one run; a CUDA graph keeps what was set when
it was captured).
"""
from __future__ import annotations

import os

import torch

import triton  # after zipmoe.kernels (the package) chose the interpreter on CPU-only machines
import triton.language as tl

_enabled = os.environ.get("ZIPMOE_PDL", "1") != "0"
_prefetch = os.environ.get("ZIPMOE_PDL", "1") != "noprefetch"


def set_enabled(enabled: bool, prefetch: bool = True) -> None:
    """PDL, and the weight prefetch before each wait, on or off for launches from now on."""
    global _enabled, _prefetch
    _enabled, _prefetch = enabled, prefetch


def enabled(device: torch.device) -> bool:
    device = torch.device(device)
    return (_enabled and device.type == "cuda" and os.environ.get("TRITON_INTERPRET") != "1"
            and torch.cuda.get_device_capability(device)[0] >= 9)


def launch_options(device: torch.device, prefetch: bool = False) -> dict:
    """The keywords a kernel launch adds: `PDL` (the kernel's constexpr) and `launch_pdl`; with
    prefetch, the `PREFETCH` constexpr of a kernel that calls `prefetch_l2`."""
    on = enabled(device)
    options = {"PDL": True, "launch_pdl": True} if on else {"PDL": False}
    if prefetch:
        options["PREFETCH"] = on and _prefetch
    return options


@triton.jit
def wait_for_inputs(PDL: tl.constexpr):
    """Every earlier kernel done and its writes visible; then the next kernel may launch."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def prefetch_l2(w_ptr, rows, row_len, k_start, k_end, PREFETCH: tl.constexpr):
    """Ask L2 for w[rows, k_start:k_end] (row-major, `row_len` columns; every row in range),
    a 32-byte sector a lane, without waiting for it; called before `wait_for_inputs`, so the
    weight's read overlaps the kernel still running."""
    if PREFETCH:
        sector = tl.arange(0, 16) * 16  # 16 elements: a sector of bf16 (of float32, every other one)
        for k0 in range(k_start, k_end, 256):
            k = tl.minimum(k0 + sector, k_end - 1)
            tl.inline_asm_elementwise("prefetch.global.L2 [$1]; // $0", "=r,l",
                                      [w_ptr + rows[:, None].to(tl.int64) * row_len + k[None, :]],
                                      dtype=tl.int32, is_pure=False, pack=1)
