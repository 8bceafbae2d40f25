"""Turns on a shared GPU: while vision_encoder works on a request, moe_decoder launches no step.

Why. vision_encoder and moe_decoder are two processes, each with its own CUDA context on the same
GPU, and the GPU time-slices between contexts. A 30-image forward (about 72 ms at the 30B shape on
an H200) then stretches every decode step that runs beside it, and the running streams see some
ten slow gaps per image request: about 3 % of all their gaps above 2.5x the median in the
`mixed` bench, where the prompt's own step gives one long gap per stream per request (0.4 %;
docs/PERFORMANCE.md, session 15). Taking turns, the tower's work runs alone, the streams pause
once for it, and the request's prompt step follows at once: one long gap per stream and request.

How. The holder, vision_encoder with `gpu_turn_ms` > 0, writes into a shared segment of its
server and GPU (`shared_level`'s slots, one per holder) the CLOCK_MONOTONIC deadline up to which it
holds the GPU: now + gpu_turn_ms when a batch of requests starts, now + HANDOFF_MS when its
responses are built (the time they take to reach moe_decoder), so a holder that dies or hangs
blocks nobody for longer. The waiter, moe_decoder's engine thread before a step while it has work,
sleeps while any holder's deadline is ahead (the deadline it saw first, or a release's if sooner),
and stops at once when a request arrives after the release (the image request whose tokens were
just made: the step that follows admits it, and that turn is not waited for again). A request that
arrives while the holder still works is someone else's (a running stream's next question) and waits
for the turn too: ended by it, the turn left the tower's work beside a run of time-sliced steps,
which in the `mixed` bench gave each stream 1.6 long gaps in that window instead of one (session 22). It never holds back two steps in a
row, so back-to-back turns still leave the streams a step between them. With async scheduling a
step is already on the GPU when the wait starts: the decoder reads it back and sends its tokens
before it sleeps (`held()`), so a stream pauses once per image request, from its last token before
the turn to the prompt step's. (Sent after the wait, with the prompt step launched, those tokens
split the pause in two long gaps: session 18's `mixed` run, docs/PERFORMANCE.md.) A batch without
images (text-only requests pass through vision_encoder in mm_qa) takes no turn. Devices other than
CUDA take no turns: `turn_path` is None for them.
"""
from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from pathlib import Path

import torch

from .shared_level import LevelReader, LevelWriter, segment_path

HANDOFF_MS = 10.0  # the holder's outputs reach moe_decoder within a few ms (session 14's trace: ~1 ms)
POLL_S = 0.0002


def turn_path(model_folder: str | Path, device: torch.device | str) -> Path | None:
    """The segment of a server's GPU (args["model_repository"] of any of its models), None off CUDA.
    A bare `cuda` is the current device, the one its kernels run on."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    return segment_path(model_folder, f"gpu{index}-turn")


class TurnHolder:
    """vision_encoder's side: `with holder.held(images > 0): ...` around the work of one execute()."""

    def __init__(self, path: Path | None, turn_ms: float):
        self.turn_ns = int(turn_ms * 1e6)
        self._writer = LevelWriter(path) if path is not None and turn_ms > 0 else None

    @contextlib.contextmanager
    def held(self, active: bool = True):
        """active False (a batch without images: text-only requests pass through the tower's model
        in mm_qa): no turn, the decoder is not held back for them."""
        if self._writer is None or not active:
            yield
            return
        self._writer.write(time.monotonic_ns() + self.turn_ns)
        try:
            yield
        finally:
            self._writer.write(time.monotonic_ns() + int(HANDOFF_MS * 1e6))

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()


class TurnWaiter:
    """moe_decoder's side: `wait()` before each step."""

    def __init__(self, path: Path | None):
        self._reader = LevelReader(path) if path is not None else None
        self._answered = 0  # the deadline of the last turn a request's arrival ended
        self._waited_last = False  # the last call held its step back: this one lets the step go

    def held(self) -> bool:
        """Whether wait() would sleep now: a holder's deadline is ahead, its request has not arrived,
        and the last call let its step go."""
        if self._reader is None or self._waited_last:
            return False
        current = self._reader.read()
        return current > time.monotonic_ns() and current != self._answered

    def wait(self, arrived: Callable[[], bool]) -> float:
        """Sleeps while a holder's deadline is ahead, or until arrived() says a request came once the
        holder released (its deadline a hand-off away); returns the seconds slept (0.0 when no holder
        holds the GPU, and after a call that slept). A release shortens the wait, a turn taken meanwhile
        never lengthens it, and a turn whose request has arrived is not waited for again."""
        if self._reader is None or self._waited_last:
            self._waited_last = False
            return 0.0
        start = now = time.monotonic_ns()
        until = current = self._reader.read()
        handoff = int(HANDOFF_MS * 1e6)
        while until > now and current != self._answered:
            if current - now <= handoff and arrived():
                self._answered = current
                break
            time.sleep(POLL_S)
            now, current = time.monotonic_ns(), self._reader.read()
            until = min(until, current)
        self._waited_last = now > start
        return (now - start) / 1e9
