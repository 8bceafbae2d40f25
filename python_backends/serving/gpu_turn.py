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
split the pause in two long gaps: session 18's `mixed` run, docs/PERFORMANCE.md.) The holder, for its
part, starts its work only once the decoder has no step on the GPU: the decoder shows its state in a
second segment (`paused_path`: 0 idle, BUSY while it has work, the deadline it pauses for), and the
holder waits while it reads BUSY, at most PAUSE_WAIT_MS. Why: in session 22's `mixed` runs 1.4-1.5
long gaps per stream started in the turn's window, not one; the likely cause (not measured) is the
tower's first kernels sharing the GPU with the step in flight, which then runs slow. (Turns back to
back: the step the decoder lets go after a wait may still run beside the next turn, whose holder then
starts after PAUSE_WAIT_MS.) A batch without
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
PAUSE_WAIT_MS = 25.0  # the decoder's step in flight, then the one it may launch before it looks (~7-12 ms each)
POLL_S = 0.0002
BUSY = 1  # the decoder's state while it has work (0: idle; a deadline: paused for that turn)


def paused_path(turn: Path) -> Path:
    """The segment where the decoder shows its state to the holders of the turn segment `turn`."""
    return turn.with_name(turn.name + "-paused")


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
        self._decoder = LevelReader(paused_path(path)) if self._writer is not None else None

    @contextlib.contextmanager
    def held(self, active: bool = True):
        """active False (a batch without images: text-only requests pass through the tower's model
        in mm_qa): no turn, the decoder is not held back for them."""
        if self._writer is None or not active:
            yield
            return
        self._writer.write(time.monotonic_ns() + self.turn_ns)
        self._await_pause()
        try:
            yield
        finally:
            self._writer.write(time.monotonic_ns() + int(HANDOFF_MS * 1e6))

    def _await_pause(self) -> None:
        """Until no decoder on this GPU may have a step on it (each paused for this turn, or without work),
        at most PAUSE_WAIT_MS (a decoder that never answers, or one that lets a step go: never two held back)."""
        end = time.monotonic_ns() + int(PAUSE_WAIT_MS * 1e6)
        while BUSY in self._decoder.live_levels() and time.monotonic_ns() < end:
            time.sleep(POLL_S)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._decoder.close()


class TurnWaiter:
    """moe_decoder's side: `held()`, then `wait()`, before each step; `busy()` at each turn of its loop."""

    def __init__(self, path: Path | None):
        self._reader = LevelReader(path) if path is not None else None
        self._state = LevelWriter(paused_path(path)) if path is not None else None  # what the holders read
        self._shown = 0
        self._answered = 0  # the deadline of the last turn a request's arrival ended
        self._waited_last = False  # the last call held its step back: this one lets the step go
        self._seen = 0  # the deadline held() saw, the one wait() sleeps for (0: none)

    def busy(self, has_work: bool) -> None:
        """Shows the holders BUSY while the decoder has work (a step may be on the GPU), else idle (and the
        next step after an idle spell is not one that follows a held-back step)."""
        self._show(BUSY if has_work else 0)
        if not has_work:
            self._waited_last = False

    def _show(self, state: int) -> None:
        if self._state is not None and state != self._shown:
            self._state.write(state)
            self._shown = state

    def close(self) -> None:
        if self._state is not None:
            self._state.close()
            self._reader.close()

    def held(self, working: bool = False) -> bool:
        """Whether wait() will sleep: a holder's deadline is ahead, its request has not arrived, and
        the last wait() let its step go; working: only while the holder still works (its deadline more
        than a hand-off ahead: after its release the request that came may be its own). The caller
        reads back its step in flight in between."""
        self._seen = 0
        if self._reader is None or self._waited_last:
            return False
        current, now = self._reader.read(), time.monotonic_ns()
        if current > now + (int(HANDOFF_MS * 1e6) if working else 0) and current != self._answered:
            self._seen = current
        return bool(self._seen)

    def wait(self, arrivals: Callable[[], int], stopping: Callable[[], bool]) -> float:
        """Sleeps for the turn held() saw: while a holder's deadline is ahead, until a request arrives
        after the holder released (its deadline a hand-off away; arrivals() counts the requests that
        reached the decoder, so one that came during the turn does not end it), or until stopping().
        Returns the seconds slept: 0.0 when held() saw no turn, and after a call that slept. A release
        shortens the wait, a turn taken meanwhile never lengthens it, and a turn whose request has
        arrived is not waited for again. (A wait that starts after the release counts from its start:
        a request queued just before it then waits out the hand-off, HANDOFF_MS.)"""
        if not self._seen:
            self._waited_last = False
            return 0.0
        start = now = time.monotonic_ns()
        until = current = self._seen
        handoff, before = int(HANDOFF_MS * 1e6), None  # before: the arrivals counted at the release
        self._show(current)  # paused: the holder may start
        while until > now and current != self._answered and not stopping():
            if current - now <= handoff:
                count = arrivals()
                if before is None:
                    before = count
                elif count > before:
                    self._answered = current
                    break
            time.sleep(POLL_S)
            now, current = time.monotonic_ns(), self._reader.read()
            until = min(until, current)
        self._seen = 0
        self._waited_last = now > start
        self._show(BUSY)
        return (now - start) / 1e9
