"""Load-adaptive keep ratio: how loaded moe_decoder is, and how much VisionZip keeps because of it.

moe_decoder measures the load and holds the *degradation level* (0 .. MAX_LEVEL); vision_encoder
(mm_qa) and mm_qa_bls, which choose each request's keep ratio, read it through `shared_level` (with
one moe_decoder instance per GPU, each has its own level, and they follow the highest).

**Pressure**, sampled once per metrics period by `DecoderService`, is the largest of
- requests waiting for admission / `max_num_seqs` (more than a full batch waits),
- KV blocks in use / KV_HIGH_WATER (admission is about to stall on memory),
- time to first token / `ttft_target_ms`, where the TTFT is the larger of the p90 over the first
  tokens of the last TTFT_WINDOW_S and the age of the oldest request still without one (a queue
  that grows shows there before any of its requests has a first token to measure).
1 is "at the limit". The decoder's TTFT counts from its own arrival, so a backlog in front of the
vision tower raises no pressure, and fewer kept tokens would not shorten it either.

**Hysteresis** (`DegradationController`): the level goes up one step after the pressure has stayed
at or above UP_PRESSURE for UP_AFTER_S, and down one step after it has stayed at or below
DOWN_PRESSURE for DOWN_AFTER_S; in between, or after each step, the clock starts again. A pressure
hovering at 1 can only move the level up (once per UP_AFTER_S, until the pressure falls); it takes
a pressure well below the limit, held five times as long, to bring it down. Degrading fast and
recovering slowly is on purpose: a request degraded too long costs some quality, one queued too
long may cost its whole answer.

**Priority** (client input, 0 .. MAX_PRIORITY, default DEFAULT_PRIORITY): 0 is never degraded.
Priority p >= 1 is degraded by `steps(level, p)` = level - (MAX_PRIORITY - p) steps, between 0 and
STEPS: the highest priority number from level 1, each lower one a level later, so by MAX_LEVEL
every degradable request is at keep_ratio_min. A request's keep ratio is its base (its own
visual_keep_ratio, else vision_encoder's keep_ratio) lowered by steps / STEPS of the way to
keep_ratio_min; a base already at or below keep_ratio_min stays as it is (`degraded_keep`).
"""
from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass
from typing import Callable

import numpy as np

from ..settings import setting
from .errors import BadInput

STEPS = 4  # keep-ratio steps from the base down to keep_ratio_min
MAX_PRIORITY = 2
DEFAULT_PRIORITY = 1
MAX_LEVEL = STEPS + MAX_PRIORITY - 1  # priority 1 reaches keep_ratio_min here

UP_PRESSURE, UP_AFTER_S = 1.0, 1.0
DOWN_PRESSURE, DOWN_AFTER_S = 0.6, 5.0
KV_HIGH_WATER = 0.9
TTFT_WINDOW_S = 5.0

# Prometheus counter of vision_encoder and mm_qa_bls (each counts the requests whose keep it chose),
# labelled by priority; only priorities >= 1 can be degraded.
DEGRADED = ("zipmoe_degraded_requests_total", "Requests with images whose keep ratio the degradation level lowered")
DEGRADABLE = tuple(range(1, MAX_PRIORITY + 1))


@dataclass(frozen=True)
class DegradationConfig:
    """moe_decoder's settings of the controller (the keep range is VisionZip's: vision_encoder's config)."""
    ttft_target_ms: int = setting(2000, "time to first token in moe_decoder the load-adaptive keep ratio holds "
                                        "the p90 under, by lowering the keep ratio (0: off, level always 0)",
                                  min=0)


def check_priority(priority: int) -> int:
    if not 0 <= priority <= MAX_PRIORITY:
        raise BadInput(f"priority must be 0 (never degraded) to {MAX_PRIORITY} (degraded first), got {priority}")
    return priority


def steps(level: int, priority: int) -> int:
    """Keep-ratio steps (0 .. STEPS) a request of this priority goes down at this level."""
    if priority == 0:
        return 0
    return min(STEPS, max(0, level - (MAX_PRIORITY - priority)))


def degraded_keep(base: float, keep_min: float, level: int, priority: int) -> float:
    """The keep ratio of a request whose own would be `base`."""
    if base <= keep_min:
        return base
    return base - (base - keep_min) * steps(level, priority) / STEPS


class KeepChooser:
    """vision_encoder's and mm_qa_bls's side: each request's keep ratio at the current level, and
    the count of requests with images it lowered, by priority (`DEGRADED`)."""

    def __init__(self, keep_ratio: float, keep_ratio_min: float, level: Callable[[], int]):
        self.keep_ratio, self.keep_ratio_min, self.level = keep_ratio, keep_ratio_min, level
        self.degraded = dict.fromkeys(DEGRADABLE, 0)
        self._lock = threading.Lock()  # mm_qa_bls chooses on several worker threads

    def choose(self, requested: float | None, priority: int, images: int) -> float:
        """requested: the client's visual_keep_ratio (None: keep_ratio); priority: checked already."""
        base = self.keep_ratio if requested is None else requested
        keep = degraded_keep(base, self.keep_ratio_min, self.level(), priority)
        if images and keep < base:
            with self._lock:
                self.degraded[priority] += 1
        return keep


class RecentTTFT:
    """Times to first token of the last TTFT_WINDOW_S, by when the first token came."""

    def __init__(self, window_s: float = TTFT_WINDOW_S):
        self.window_s = window_s
        self._samples: deque[tuple[float, float]] = deque()  # (time of the first token, seconds)

    def add(self, now: float, seconds: float) -> None:
        self._forget(now)
        self._samples.append((now, seconds))

    def p90(self, now: float) -> float:
        self._forget(now)
        return float(np.percentile([s for _, s in self._samples], 90)) if self._samples else 0.0

    def _forget(self, now: float) -> None:
        while self._samples and self._samples[0][0] < now - self.window_s:
            self._samples.popleft()


@dataclass(frozen=True)
class Load:
    """One sample of what the pressure is made of."""
    waiting: int  # requests submitted and not admitted
    kv_used: float  # fraction of KV blocks held
    ttft_s: float  # recent TTFT p90, or the oldest request's wait for its first token if longer

    def pressure(self, max_num_seqs: int, ttft_target_s: float) -> float:
        return max(self.waiting / max_num_seqs, self.kv_used / KV_HIGH_WATER, self.ttft_s / ttft_target_s)


class DegradationController:
    """The level, from pressure samples over time (deterministic: time is passed in)."""

    def __init__(self, ttft_target_ms: int, max_num_seqs: int):
        if ttft_target_ms <= 0:
            raise ValueError("ttft_target_ms must be positive (0 turns the controller off: do not build one)")
        self.ttft_target_s, self.max_num_seqs = ttft_target_ms / 1000, max_num_seqs
        self.level, self.pressure = 0, 0.0
        self._regime, self._since = 0, 0.0  # +1 high, -1 low, 0 between; when the current run of it began

    def update(self, now: float, load: Load) -> int:
        """Takes one sample; returns the level (changed by at most one step)."""
        self.pressure = load.pressure(self.max_num_seqs, self.ttft_target_s)
        regime = 1 if self.pressure >= UP_PRESSURE else -1 if self.pressure <= DOWN_PRESSURE else 0
        if regime != self._regime:
            self._regime, self._since = regime, now
        dwell = {1: UP_AFTER_S, -1: DOWN_AFTER_S}.get(regime)
        if dwell is not None and now - self._since >= dwell and 0 <= self.level + regime <= MAX_LEVEL:
            self.level += regime
            self._since = now  # the next step waits a whole dwell again
        return self.level

    def explain(self, load: Load) -> str:
        """Which signal drives the pressure, for the log line of a level change."""
        return (f"pressure {self.pressure:.2f}: waiting {load.waiting} / max_num_seqs {self.max_num_seqs}, "
                f"KV {load.kv_used:.0%} / {KV_HIGH_WATER:.0%}, "
                f"TTFT {load.ttft_s * 1000:.0f} ms / {self.ttft_target_s * 1000:.0f} ms")
