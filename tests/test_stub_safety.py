"""models/stub_safety.py without a server: Keepalive's holding time, requested_outputs."""
from __future__ import annotations

from zipmoe.models.stub_safety import Keepalive, requested_outputs


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_keepalive_drops_an_object_only_after_its_time_on_a_later_hold():
    clock = Clock()
    keep = Keepalive(seconds=5.0, clock=clock)
    first, second = object(), object()
    keep.hold(first)
    clock.now = 4.9
    keep.hold(second)
    assert len(keep) == 2  # first is 4.9 s old: still held
    clock.now = 5.0
    keep.hold(object())
    assert len(keep) == 2  # first went; second (0.1 s old) and the new one stay
    clock.now = 100.0
    keep.hold(object())
    assert len(keep) == 1


def test_keepalive_of_zero_seconds_holds_nothing_past_the_call():
    keep = Keepalive(seconds=0.0, clock=Clock())
    keep.hold(object())
    assert len(keep) == 0


def test_requested_outputs_is_the_requests_list():
    class Request:
        def requested_output_names(self):
            return ["text_output", "finish_reason"]

    assert requested_outputs(Request()) == frozenset({"text_output", "finish_reason"})
