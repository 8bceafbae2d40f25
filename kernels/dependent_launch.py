"""Programmatic dependent launch (PDL, Hopper and later) for the decode step's kernels.

A batch-1 decode step is about ten launches a layer, most of them a few microseconds long, and
in a CUDA graph each still starts only after the one before has finished and flushed: the
launch, the ramp-up of its first wave and the drain of the last are paid every time, while HBM
sits idle. With PDL a kernel is launched while the one before is still running; its programs
wait in `wait_for_inputs` until every earlier kernel has finished and its writes are visible,
then let the next kernel launch in turn. (Asking L2 for the q/k/v and router weights before the
wait was measured too, session 20: 2 % slower at batch 1 and 9 % at 4, 2-3 % faster at 16 and
64; not kept. So was asking L2 for the next launch's weights from extra programs of a launch bound
by latency, session 36: the output projection's by the attention, an expert's down rows by its
gate/up programs, with `prefetch.global.L2`; the batch-1 step 7 % slower, each alone 2-3 %, as the
launches that asked took longer than the ones that found their weights in L2 gained; not kept.
Session 42 asked with one bulk request a row (`cp.async.bulk.prefetch.L2`): the attention's
extra programs for the output projection's columns loaded after its wait, even with the step
(+0.6 % at a 256-token context, -0.1 % at 4,096); the gate/up programs for their guessed
expert's rows before their wait, an illegal memory access in the 48-layer step though not in the
one-layer tests, not diagnosed; neither kept.)

The rule every kernel here keeps: it calls `wait_for_inputs` before it reads or writes memory,
in every program, so waiting on the kernel just before is waiting on all of them. A launch
without the flag (cuBLAS, PyTorch's own kernels) is ordered as usual, and a kernel with it that
follows one simply starts when that one ends.

Exceptions, all for memory the launch before does not write. (A launch starts only once every
program of the one before has passed its own wait, `wait_for_inputs` letting the next go after
it: so at most two launches overlap, and only the one just before can still be writing.)
- A layer's weights: the q/k/v launch and the folded output projection (`qkv_norm_rope`,
  `folded_router`) load `load_ahead` of each program's weight (half) before their wait, while the
  launch before (the experts' down GEMM, the attention) still runs, and the rest after it (the
  projection's Gluon launch on Hopper, `out_proj_smem`: all of it, into shared memory). The
  batch-1 step on an H100, one run (session 37, graph replay): 3,269 / 3,273 us against 3,375
  with none ahead and 3,628 with all (registers and bandwidth taken from the launch before for
  the whole of its run).
- The fold's down GEMM as its own launch (`folded_router.FUSED_DOWN` off; on, the gate/up programs
  run it): the gate/up launch's routing program stores the experts early, then raises a ready flag
  (which the output projection's launch lowered), and the down GEMM's programs, waiting for it a
  bounded while, load half their experts' rows before their wait
  (`fused_moe.down_per_slot`'s ready): the batch-1 step 2.2 % faster in its first run, 6.7 %
  with the fold's GEMMs at 3 stages (session 38, `bench_one_token`).
- The residual stream r in the folded output projection (`folded_router`: the rows' r, the
  router's sums over r; session 44, 1-2 % faster): r was written by the q/k/v launch, which ended
  before the attention's programs passed their wait and so before the projection's launch began.
- The attention's first tile of keys and values, all but each sequence's newest key, which the
  q/k/v launch before writes (`paged_attention.keys_ahead`): 3 to 5.5 % over three runs (session 38);
  only where the launch's programs are all resident at once, 1-4.6 % faster at batches 16 and 64
  (session 42).
The gate/up GEMM loads nothing ahead: its experts are known only from the logits the launch
before makes. Also measured, not kept: letting the next launch go after a kernel's main
loop instead of at its start (the attention's, the down GEMM's), so that those loads overlap only
its tail: 3,378 / 3,390 us with half ahead, against 3,280 us letting it go at the start (another
run, `docs/results/pdl_late_trigger_one_token_h100.json`).

What a boundary between two launches costs (`benchmarks/bench_pdl_release.py`, H100, session
43): from the last program of one launch ending to the programs of the next going on, 1.8-2.3 us
for a plain launch, 0.8-1.0 us with PDL's wait, and 0.3-1.0 us for a counter that the next
launch's programs spin on. A counter is what merging two launches into one would pay instead, so
merging saves at most about 0.5 us a boundary.

`launch_options(device)` gives a Triton launch its two keywords: the kernel's `PDL` constexpr
and Triton's `launch_pdl`. Off without CUDA (the interpreter), before compute capability 9.0, and
where ZIPMOE_PDL=0; `enabled_as` sets it for a block of a running process (the benchmarks compare
both in one run; a CUDA graph keeps what was set when it was captured).
"""
from __future__ import annotations

import contextlib
import functools
import os

import torch

import triton  # after zipmoe.kernels (the package) chose the interpreter on CPU-only machines
import triton.language as tl

_enabled = os.environ.get("ZIPMOE_PDL", "1") != "0"
# The share of its weight a program of the q/k/v and output-projection launches loads ahead of its
# wait (`ahead_width`); the benchmarks set others (bench_one_token).
load_ahead = 0.5


@contextlib.contextmanager
def enabled_as(enabled: bool):
    """PDL on or off for the launches inside the block (a graph captured there keeps it), then as
    it was."""
    global _enabled
    saved, _enabled = _enabled, enabled
    try:
        yield
    finally:
        _enabled = saved


@functools.lru_cache(maxsize=None)
def hopper_or_later(device: torch.device) -> bool:  # cached: an eager prefill step launches thousands of kernels
    """A CUDA device of compute capability 9.0 or later, outside Triton's interpreter (PDL; also the
    Gluon output projection, `out_proj_smem`)."""
    return (device.type == "cuda" and os.environ.get("TRITON_INTERPRET") != "1"
            and torch.cuda.get_device_capability(device)[0] >= 9)


def launch_options(device: torch.device) -> dict:
    """The keywords a kernel launch adds: `PDL` (the kernel's constexpr) and `launch_pdl`."""
    return {"PDL": True, "launch_pdl": True} if _enabled and hopper_or_later(torch.device(device)) else {"PDL": False}


def ahead_width(width: int, step: int) -> int:
    """Columns of a program's weight, `width` wide and read `step` columns at a time, to load ahead
    of its wait: `load_ahead` (0 to 1) of them in a power of two of whole steps (0: none)."""
    steps = int(width * min(max(load_ahead, 0.0), 1.0)) // step
    return step << (steps.bit_length() - 1) if steps else 0


@triton.jit
def wait_for_inputs(PDL: tl.constexpr):
    """Every earlier kernel done and its writes visible; then the next kernel may launch."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()

