"""Python's garbage collector in the decoder's process, counted for the metrics.

A collection holds the interpreter lock, so the engine loop and the response writers all wait for
it. Once torch, transformers and Triton are imported and the engine is built, the process tracks
some 340,000 objects, and a full collection walks all of them (about 190 ms on the development
machine's CPU). `GcPauses` times every collection (`gc.callbacks`), so `zipmoe_gc_*` shows whether any
stalls the engine. (On the H200, in a 30 s `mixed` benchmark at the 30B size, none ran.)
"""
from __future__ import annotations

import gc
import time


class GcPauses:
    """Counts collections (all, and full ones) and their summed duration, from every thread."""

    def __init__(self):
        self.collections = self.full_collections = 0
        self.pause_us = 0.0
        self._start = 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
            return
        self.collections += 1
        self.full_collections += info["generation"] == 2
        self.pause_us += (time.perf_counter() - self._start) * 1e6

    def stats(self) -> dict[str, float]:
        return {"gc_collections": self.collections, "gc_full_collections": self.full_collections,
                "gc_pause_us": round(self.pause_us)}

    def close(self) -> None:
        if self._callback in gc.callbacks:  # a second shutdown finds it gone
            gc.callbacks.remove(self._callback)
