"""Counters for kernels that finish their work in the last program to arrive, and the Triton
pieces those kernels share.

A kernel split over programs that each compute a share (splits of the router's logits, of a decode
context, of the q/k/v projection's input width) needs one more step over all the shares (the
top-K, the log-sum-exp merge, the q/k norms and RoPE). Instead of a second launch, each program
stores its share and calls `last_to_arrive`: one atomic add on its group's counter, after a
barrier (the atomic is one thread's: the barrier puts every thread's stores before it). The
program that sees the count reach the group's size holds every share (the atomic's
acquire-release ordering at GPU scope makes the others' stores visible; it reads them with .cg
loads, from L2, as `sum_splits` does), does the last step, and has set the counter back to zero
for the next launch. `split_width` cuts a width into splits of whole blocks.

The counters live as long as the process, one fixed-size buffer per kernel and device, allocated
by the first (eager) call: a CUDA graph that captures the kernel keeps their address, so the
buffer is never replaced or grown. One buffer per kernel and device means one launch of a kernel at
a time on a device: the engine runs every step on one stream. Two launches of the same kernel
running at once on two streams would count into each other's groups.
"""
from __future__ import annotations

import torch

import triton  # after zipmoe.kernels (the package) chose the interpreter on CPU-only machines
import triton.language as tl

_buffers: dict[tuple[str, torch.device], torch.Tensor] = {}


def arrival_counters(kernel: str, device: torch.device, size: int) -> torch.Tensor:
    """The zeroed int32 counters [size] of `kernel` on `device` (the same tensor at every call)."""
    key = (kernel, torch.device(device))
    if key not in _buffers:
        if torch.device(device).type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"{kernel}: run it once before a CUDA graph captures it (its counters are made then)")
        _buffers[key] = torch.zeros(size, dtype=torch.int32, device=device)
    buffer = _buffers[key]
    if buffer.numel() != size:
        raise ValueError(f"{kernel}: arrival counters were made for {buffer.numel()} groups, not {size}")
    return buffer


@triton.jit
def last_to_arrive(counter_ptr, count):
    """Called by each of a group's `count` programs after its stores: True in the one that checks in
    last, which then sees every other program's stores (read them with .cg loads, from L2) and has
    set the counter back to zero for the next launch (and graph replay)."""
    tl.debug_barrier()  # every thread's stores done before the one-thread release-acquire check-in
    last = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu") == count - 1
    if last:
        tl.store(counter_ptr, 0)
    return last


@triton.jit
def sum_splits(partial_ptr, rows, cols, T, width, splits, mask, MAX_SPLIT: tl.constexpr):
    """[rows, cols] of float32 partials laid out [split, T, width], summed over the launch's `splits`
    (unrolled to MAX_SPLIT, the rest masked off: every load independent, so all in flight). Read in
    the program `last_to_arrive` chose."""
    at = partial_ptr + rows[:, None] * width + cols[None, :]
    total = tl.load(at, mask=mask, other=0.0, cache_modifier=".cg")
    for s in tl.static_range(1, MAX_SPLIT):
        total += tl.load(at + s * T * width, mask=mask & (s < splits), other=0.0, cache_modifier=".cg")
    return total


def split_width(width: int, splits: int, block: int) -> int:
    """Columns per split of `width` cut into `splits` shares of whole blocks (the last may be short,
    or empty: its programs store zeros)."""
    return triton.cdiv(triton.cdiv(width, splits), block) * block
