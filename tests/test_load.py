"""serving.load (the load-adaptive keep ratio's policy and controller) on synthetic pressure traces, and
serving.shared_level (the level across processes, one slot per moe_decoder instance)."""
from __future__ import annotations

import multiprocessing
import os
import struct

import pytest

from zipmoe.serving.errors import BadInput
from zipmoe.serving.load import (DOWN_AFTER_S, DOWN_PRESSURE, MAX_LEVEL, MAX_PRIORITY, STEPS, UP_AFTER_S,
                                 DegradationController, KeepChooser, Load, RecentTTFT, check_priority,
                                 degraded_keep, steps)
from zipmoe.serving.shared_level import SIZE, SLOTS, LevelReader, LevelWriter, segment_path

PERIOD = 0.1
TARGET_MS = 1000


def trace(pressures, controller=None) -> list[int]:
    """The level after each sample of a pressure trace sampled every PERIOD (pressure through the TTFT)."""
    controller = controller or DegradationController(TARGET_MS, max_num_seqs=8)
    return [controller.update(i * PERIOD, Load(0, 0.0, p * TARGET_MS / 1000)) for i, p in enumerate(pressures)]


def periods(seconds: float) -> int:
    return round(seconds / PERIOD)


def changes(levels: list[int]) -> int:
    return sum(a != b for a, b in zip(levels, levels[1:]))


def test_sustained_pressure_climbs_one_step_per_dwell_to_the_top_and_stays():
    levels = trace([1.5] * periods(UP_AFTER_S * (MAX_LEVEL + 3)))
    assert levels[periods(UP_AFTER_S) - 1] == 0 and levels[periods(UP_AFTER_S)] == 1
    assert all(b - a in (0, 1) for a, b in zip(levels, levels[1:]))  # one step at a time
    assert levels[-1] == MAX_LEVEL and changes(levels) == MAX_LEVEL


def test_a_short_burst_does_not_move_the_level():
    burst = [2.0] * (periods(UP_AFTER_S) - 1)
    assert set(trace(([0.8] * 5 + burst) * 10)) == {0}


def test_pressure_hovering_at_the_threshold_never_oscillates():
    """Alternating just above and below 1 (and sitting in the band between the thresholds) can only hold
    or raise the level: going down needs DOWN_PRESSURE held for DOWN_AFTER_S."""
    hovering = [1.02, 0.98] * periods(20)
    levels = trace(hovering)
    assert changes(levels) == 0  # never UP_AFTER_S above in a row
    band = trace([1.2] * (periods(UP_AFTER_S) + 1) + [DOWN_PRESSURE + 0.05] * periods(30))
    assert band[-1] == 1 and changes(band) == 1  # up once, then held in the band
    noisy = trace([1.05 if i % 7 else 0.95 for i in range(periods(30))])
    assert all(b >= a for a, b in zip(noisy, noisy[1:]))  # a dip below 1 never brings it down


def test_recovery_takes_one_step_per_down_dwell():
    c = DegradationController(TARGET_MS, max_num_seqs=8)
    start = periods(UP_AFTER_S * 3) + 1  # samples at 0 .. 3 dwells
    trace([2.0] * start, c)
    assert c.level == 3
    levels = [c.update((start + i) * PERIOD, Load(0, 0.0, 0.1)) for i in range(periods(DOWN_AFTER_S * 4))]
    assert levels[periods(DOWN_AFTER_S) - 1] == 3 and levels[periods(DOWN_AFTER_S)] == 2
    assert levels[-1] == 0 and changes(levels) == 3


def test_each_signal_makes_pressure():
    assert Load(16, 0.0, 0.0).pressure(max_num_seqs=8, ttft_target_s=1.0) == 2.0
    assert Load(0, 0.45, 0.0).pressure(8, 1.0) == pytest.approx(0.5)
    assert Load(2, 0.45, 3.0).pressure(8, 1.5) == 2.0
    with pytest.raises(ValueError, match="ttft_target_ms"):
        DegradationController(0, 8)


def test_priority_zero_is_never_degraded_and_higher_numbers_go_first_and_further():
    for level in range(MAX_LEVEL + 1):
        assert steps(level, 0) == 0
        assert [steps(level, p) for p in range(1, MAX_PRIORITY + 1)] == sorted(
            steps(level, p) for p in range(1, MAX_PRIORITY + 1))
    assert [steps(level, MAX_PRIORITY) for level in range(MAX_LEVEL + 1)] == [0, 1, 2, 3, 4, 4]
    assert [steps(level, 1) for level in range(MAX_LEVEL + 1)] == [0, 0, 1, 2, 3, 4]
    assert steps(MAX_LEVEL, 1) == STEPS  # the top level takes every degradable request to keep_ratio_min


def test_the_keep_ratio_goes_from_the_base_to_keep_ratio_min():
    assert degraded_keep(0.6, 0.2, 0, 2) == 0.6
    assert degraded_keep(0.6, 0.2, 2, 2) == pytest.approx(0.4)
    assert degraded_keep(0.6, 0.2, MAX_LEVEL, 1) == pytest.approx(0.2)
    assert degraded_keep(0.6, 0.2, MAX_LEVEL, 0) == 0.6
    assert degraded_keep(1.0, 0.2, 3, 2) == pytest.approx(0.4)  # a request's own ratio is its base
    assert degraded_keep(0.15, 0.2, MAX_LEVEL, 2) == 0.15  # never raised to keep_ratio_min


def test_priorities_out_of_range_are_refused():
    assert [check_priority(p) for p in range(MAX_PRIORITY + 1)] == list(range(MAX_PRIORITY + 1))
    for bad in (-1, MAX_PRIORITY + 1):
        with pytest.raises(BadInput, match="priority must be 0"):
            check_priority(bad)


def test_the_chooser_counts_degraded_requests_with_images_by_priority():
    level = [0]
    chooser = KeepChooser(0.6, 0.2, lambda: level[0])
    assert chooser.choose(None, 2, images=3) == 0.6
    level[0] = MAX_LEVEL
    assert chooser.choose(None, 0, images=3) == 0.6
    assert chooser.choose(None, 2, images=3) == pytest.approx(0.2)
    assert chooser.choose(0.9, 1, images=1) == pytest.approx(0.2)
    assert chooser.choose(None, 1, images=0) == pytest.approx(0.2)  # text only: nothing to degrade, not counted
    assert chooser.degraded == {1: 1, 2: 1}


def test_recent_ttft_is_the_p90_of_the_window():
    recent = RecentTTFT(window_s=5.0)
    assert recent.p90(0.0) == 0.0
    for i in range(10):
        recent.add(float(i), float(i + 1))  # at t=i a first token after i+1 s
    assert recent.p90(9.0) == pytest.approx(9.5)  # t=4..9: TTFTs 5..10
    assert recent.p90(100.0) == 0.0  # all older than the window


def _read_levels(path, ready, wrote, out):
    reader = LevelReader(path)
    out.put(reader.read())  # nothing written yet: 0
    ready.set()
    assert wrote.wait(30)
    reader._check_at = 0.0  # look again at once rather than after RECHECK_S
    out.put(reader.read())


def test_the_level_crosses_processes(tmp_path):
    path = tmp_path / "level"
    ctx = multiprocessing.get_context("spawn")
    ready, wrote, out = ctx.Event(), ctx.Event(), ctx.Queue()
    child = ctx.Process(target=_read_levels, args=(path, ready, wrote, out))
    child.start()
    try:
        assert ready.wait(60) and out.get(timeout=10) == 0  # absent: level 0
        writer = LevelWriter(path)
        writer.write(3)
        wrote.set()
        assert out.get(timeout=30) == 3
        child.join(30)
        assert child.exitcode == 0
        assert path.exists()  # the reader's exit left the segment alone
        writer.close()
        assert not path.exists()
    finally:
        if child.is_alive():
            child.kill()


def _decoder_instance(path, level, wrote, done):
    """A moe_decoder instance's process: claims a slot, writes its level, closes when told (if ever)."""
    writer = LevelWriter(path)
    writer.write(level)
    wrote.set()
    done.wait(60)
    writer.close()


def _start_instance(ctx, path, level):
    wrote, done = ctx.Event(), ctx.Event()
    child = ctx.Process(target=_decoder_instance, args=(path, level, wrote, done))
    child.start()
    assert wrote.wait(60)
    return child, done


def test_each_decoder_instance_writes_its_own_level_and_readers_take_the_highest(tmp_path):
    """Data parallel: one moe_decoder process per GPU, each with its own slot; the models that choose the
    keep ratio follow the most loaded one, and an instance unloading takes only its own level away."""
    path = tmp_path / "level"
    ctx = multiprocessing.get_context("spawn")
    reader = LevelReader(path)
    (a, done_a), (b, done_b) = _start_instance(ctx, path, 2), _start_instance(ctx, path, 5)
    try:
        assert reader.read() == 5
        done_b.set()  # the loaded instance unloads: the other's level remains
        b.join(30)
        assert b.exitcode == 0 and path.exists() and reader.read() == 2
        done_a.set()  # the last one out removes the segment
        a.join(30)
        assert a.exitcode == 0 and not path.exists() and reader.read() == 0
    finally:
        for child in (a, b):
            if child.is_alive():
                child.kill()


def test_writers_in_one_process_get_their_own_slots_until_none_is_left(tmp_path):
    path = tmp_path / "level"
    first, second = LevelWriter(path), LevelWriter(path)
    reader = LevelReader(path)
    assert first.slot != second.slot
    first.write(1)
    second.write(3)
    assert reader.read() == 3
    second.write(0)  # the loaded GPU recovers: the other one's level holds
    assert reader.read() == 1
    more = [LevelWriter(path) for _ in range(SLOTS - 2)]
    with pytest.raises(RuntimeError, match=f"all {SLOTS} slots"):
        LevelWriter(path)
    for writer in [second, *more]:
        writer.close()
    assert path.exists() and reader.read() == 1
    first.close()
    assert not path.exists()


def test_a_killed_instance_level_is_cleared_when_a_decoder_loads_again_in_place(tmp_path):
    path = tmp_path / "level"
    ctx = multiprocessing.get_context("spawn")
    child, _ = _start_instance(ctx, path, 4)
    child.kill()  # a killed server leaves its level behind, with no close()
    child.join(30)
    reader = LevelReader(path)
    assert reader.read() == 4  # until a decoder loads again on the same path
    inode = os.stat(path).st_ino
    writer = LevelWriter(path)  # the next moe_decoder on the same path takes it over
    assert os.stat(path).st_ino == inode and reader.read() == 0  # same file: the reader sees it at once
    writer.close()  # the segment removed (moe_decoder unloaded)
    assert reader.read() == 0
    again = LevelWriter(path)  # loaded again: a new file
    again.write(2)
    reader._check_at = 0.0
    assert reader.read() == 2
    again.close()


def test_a_segment_of_the_single_level_layout_is_reset(tmp_path):
    path = tmp_path / "level"
    path.write_bytes(struct.pack("<Q", 3))  # 8 bytes: the one level of an older moe_decoder
    writer = LevelWriter(path)
    assert path.stat().st_size == SIZE and LevelReader(path).read() == 0
    writer.close()


def test_segments_are_named_by_repository():
    a = segment_path("/srv/a/model_repository/moe_decoder")
    assert segment_path("/srv/a/model_repository/vision_encoder") == a
    assert segment_path("/srv/b/model_repository/moe_decoder") != a
