"""Timing shared by the benchmarks: CUDA event medians, graph replays, wall-clock medians of work
that spans the host and the device, the copy bandwidth that every achieved-bandwidth figure is read
against, and the result file a benchmark writes."""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Callable

import torch


def require_cuda(parser: argparse.ArgumentParser, device: str = "cuda") -> None:
    """Stops a benchmark that times CUDA work, before it builds anything, with its usage and a plain
    reason where the device it was given is a GPU this machine does not have."""
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        parser.error(f"this benchmark times work on a CUDA GPU ({device}) and this machine has none "
                     f"(torch {torch.__version__})")


def cuda_time_us(fn: Callable[[], object], warmup: int = 3, reps: int = 20, flush_l2: bool = False) -> float:
    """Median microseconds of `reps` CUDA-event timings of fn(), after `warmup` calls (Triton
    compilation and allocator growth are not timed). flush_l2 rewrites 256 MiB before each call,
    as a real step's other layers would evict what this one left in L2."""
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda") if flush_l2 else None
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if flush is not None:
            flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def peak_bytes(fn: Callable[[], object]) -> int:
    """Peak bytes allocated above the baseline during one call of fn()."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    result = fn()
    torch.cuda.synchronize()
    del result
    return torch.cuda.max_memory_allocated() - base


def graph_time_us(fn: Callable[[], object], calls: int, reps: int = 20, flush_l2: bool = False) -> float:
    """Median microseconds per call of fn() replayed from a CUDA graph that holds `calls` calls (as
    the engine runs decode: without the host's launch cost)."""
    fn()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return cuda_time_us(graph.replay, warmup=2, reps=reps, flush_l2=flush_l2) / calls


def copy_gbps(nbytes: int = 1 << 30) -> float:
    """Device-copy bandwidth, read + write, of an eager copy_ between two large tensors (a copy
    captured in a graph runs on a copy engine, far slower, and is the wrong reference)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    us = cuda_time_us(lambda: dst.copy_(src), warmup=3, reps=20)
    return 2 * nbytes / us / 1e3


def wall_ms(fn: Callable[[], object], cuda: bool, reps: int, warmup: int = 1) -> float:
    """Median wall milliseconds of fn() over `reps` calls after `warmup`, the device idle at both ends
    of each (cuda: synchronised): host work and device work together, as a model's request sees them."""
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def write_result(prefix: Path, result: dict) -> None:
    """PREFIX.json, its folder made if needed."""
    path = prefix.with_suffix(".json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}")
