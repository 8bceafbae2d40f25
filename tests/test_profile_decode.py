"""profile_decode's critical path (kernels/benchmarks/profile_decode.py, run on a GPU): what each
launch adds past the end of the one before, read from recorded (name, start, end) spans."""
from __future__ import annotations

import pytest

from zipmoe.kernels.benchmarks.profile_decode import critical_path


def test_each_launch_adds_its_end_past_the_previous_end_and_counts_its_overlap_and_gaps_apart():
    # Two replays of three launches: b launched early (PDL) and overlapped a by 3 us; c started
    # 1 us after b ended; the second replay starts 100 us later (the host's pause is not counted).
    one = [("a", 0.0, 10.0), ("b", 7.0, 15.0), ("c", 16.0, 20.0)]
    two = [(name, start + 100.0, end + 100.0) for name, start, end in one]
    paths = critical_path(two + one, replays=2)
    assert paths["a"] == pytest.approx({"exposed_us": 10.0, "early_us": 0.0, "gap_us": 0.0})
    assert paths["b"] == pytest.approx({"exposed_us": 5.0, "early_us": 3.0, "gap_us": 0.0})
    assert paths["c"] == pytest.approx({"exposed_us": 4.0, "early_us": 0.0, "gap_us": 1.0})
    # Exposed plus gaps is the replay's span.
    assert sum(p["exposed_us"] + p["gap_us"] for p in paths.values()) == pytest.approx(20.0)


def test_fewer_launches_recorded_than_replays_still_adds_up():
    assert critical_path([("a", 0.0, 4.0)], replays=2)["a"] == pytest.approx({"exposed_us": 2.0, "early_us": 0.0,
                                                                                "gap_us": 0.0})
