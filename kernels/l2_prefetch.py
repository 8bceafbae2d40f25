"""Asking L2 for a later launch's weights while a launch bound by latency leaves memory idle.

At batch 1 the attention moves 0.6 MB in about 7 us a layer, and the only weights read meanwhile
are the half of the output projection's that its programs load ahead of their wait. The next
layer's q/k/v weight (21 MB at Qwen3-30B-A3B's shape) depends on nothing, and its launch loads half
of it ahead of its own wait during the experts' GEMMs, where every byte competes with the experts'
for memory. `prefetch_rows` lets each program of the output projection's launch (`folded_router`,
launched while the attention runs) ask for its share of that weight's rows before its wait: one
`cp.async.bulk.prefetch.L2` a row (Hopper's bulk copy engine, one instruction per 4 kB row; no
registers or shared memory held, nothing waited for), optionally with the L2 eviction priority
"evict last" (`createpolicy`), which the L2 honours in the share set aside for persisting lines
(`set_aside_l2`; none is set aside by default).

The rows asked for are only a hint: whether they are still in L2 when the q/k/v launch reads them
changes its time, never its result.
"""
from __future__ import annotations

import ctypes
import functools

import torch

from .dependent_launch import hopper_or_later

import triton  # after zipmoe.kernels (the package) chose the interpreter on CPU-only machines
import triton.language as tl

# What a program asks for: nothing, the rows (L2's normal priority), or the rows to be evicted last.
OFF, NORMAL, EVICT_LAST = 0, 1, 2
_CU_LIMIT_PERSISTING_L2_CACHE_SIZE = 0x06
_CU_DEVICE_ATTRIBUTE_MAX_PERSISTING_L2_CACHE_SIZE = 108


@triton.jit
def prefetch_rows(w_ptr, first, rows, row_elems, ROWS: tl.constexpr, LANES: tl.constexpr, MODE: tl.constexpr):
    """Rows [first, first + ROWS) of w (at most `rows`), `row_elems` elements each (whole multiples of
    16 bytes), asked of L2, one row a thread; LANES is the program's thread count, so each row is
    asked for once."""
    lane = tl.arange(0, LANES)
    row = first + lane
    ask = ((lane < ROWS) & (row < rows)).to(tl.int32)
    at = w_ptr + tl.where(ask != 0, row, first).to(tl.int64) * row_elems
    size = tl.full([LANES], 0, tl.int32) + row_elems * (w_ptr.dtype.element_ty.primitive_bitwidth // 8)
    if MODE == 2:  # EVICT_LAST
        tl.inline_asm_elementwise(
            "{ .reg .pred p; .reg .b64 pol; setp.ne.b32 p, $2, 0; "
            "createpolicy.fractional.L2::evict_last.b64 pol, 1.0; "
            "@p cp.async.bulk.prefetch.L2.global.L2::cache_hint [$1], $3, pol; mov.b32 $0, 0; }",
            "=r,l,r,r", [at, ask, size], dtype=tl.int32, is_pure=False, pack=1)
    else:
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $3; mov.b32 $0, 0; }",
            "=r,l,r,r", [at, ask, size], dtype=tl.int32, is_pure=False, pack=1)


def usable(weight: torch.Tensor | None) -> bool:
    """Whether `prefetch_rows` may ask for weight's rows: a contiguous CUDA tensor of Hopper or later
    (the bulk copy engine), its rows whole multiples of 16 bytes from a 16-byte aligned start."""
    if weight is None or weight.device.type != "cuda" or not weight.is_contiguous() or weight.dim() != 2:
        return False
    row_bytes = weight.shape[1] * weight.element_size()
    return row_bytes % 16 == 0 and weight.data_ptr() % 16 == 0 and hopper_or_later(weight.device)


@functools.lru_cache(maxsize=None)
def _driver() -> ctypes.CDLL:
    return ctypes.CDLL("libcuda.so.1")


def set_aside_l2(nbytes: int) -> int:
    """Sets aside nbytes of the current device's L2 for persisting lines (those asked for with
    EVICT_LAST), at most the device's maximum, and returns what the driver set (it may round)."""
    torch.zeros(1, device="cuda")  # the primary context current on this thread
    driver, device, most = _driver(), ctypes.c_int(), ctypes.c_int()
    driver.cuCtxGetDevice(ctypes.byref(device))
    driver.cuDeviceGetAttribute(ctypes.byref(most), ctypes.c_int(_CU_DEVICE_ATTRIBUTE_MAX_PERSISTING_L2_CACHE_SIZE),
                                device)
    nbytes = min(nbytes, most.value)
    if driver.cuCtxSetLimit(ctypes.c_int(_CU_LIMIT_PERSISTING_L2_CACHE_SIZE), ctypes.c_size_t(nbytes)):
        raise RuntimeError("cuCtxSetLimit(CU_LIMIT_PERSISTING_L2_CACHE_SIZE) failed")
    value = ctypes.c_size_t()
    driver.cuCtxGetLimit(ctypes.byref(value), ctypes.c_int(_CU_LIMIT_PERSISTING_L2_CACHE_SIZE))
    return value.value
