"""Doorbells (serving/doorbell.py) without a server: each ring releases its stream's bell once, rings of
other or closed streams are ignored, a missing ring times out, a caller that went away loses nothing
but the ring."""
from __future__ import annotations

import threading
import time

from zipmoe.serving import doorbell
from zipmoe.serving.doorbell import Doorbells, Ring


def test_each_ring_releases_its_streams_bell_once(tmp_path):
    bells = Doorbells(str(tmp_path))
    try:
        a, b = bells.open("a"), bells.open("b")
        for _ in range(3):
            Ring(bells.path, "a").ring()
        Ring(bells.path, "b").ring()
        Ring(bells.path, "never-opened").ring()
        assert all(doorbell.wait(a, timeout=2.0) for _ in range(3))
        assert doorbell.wait(b, timeout=2.0)
        assert not doorbell.wait(a, timeout=0.05) and not doorbell.wait(b, timeout=0.05)  # no extra rings
        bells.discard("a")
        Ring(bells.path, "a").ring()
        time.sleep(0.05)
        assert not doorbell.wait(a, timeout=0.05)  # a discarded stream's rings are dropped
    finally:
        bells.close()
    assert not (tmp_path / bells.path).exists()


def test_a_waiting_reader_wakes_on_the_ring(tmp_path):
    bells = Doorbells(str(tmp_path))
    try:
        bell, woke = bells.open("t"), []
        reader = threading.Thread(target=lambda: woke.append(doorbell.wait(bell, timeout=5.0)))
        reader.start()
        time.sleep(0.05)
        Ring(bells.path, "t").ring()
        reader.join(timeout=5.0)
        assert woke == [True]
    finally:
        bells.close()


def test_no_bell_never_waits_and_a_gone_caller_loses_only_the_ring(tmp_path):
    assert doorbell.wait(None, timeout=0.0)
    Ring(str(tmp_path / "nobody.sock"), "t").ring()  # no socket there: the ring is lost, nothing raises
