"""clients/bench_mixed.py (long_gap_phases): the mixed bench's long gaps placed against the image requests."""
from zipmoe.clients.bench_mixed import long_gap_phases


def test_long_gaps_are_counted_binned_and_matched_to_first_tokens():
    # Two streams stepping every 10 ms; one image request sent at 1.000 s, first token at 1.200 s.
    steps = [round(0.01 * k, 3) for k in range(90, 131)]
    one = [t for t in steps if not 1.01 < t < 1.2]  # one long gap 1.010 -> 1.200: the turn and the prompt step
    two = [t for t in steps if not 1.04 < t < 1.07]  # one long gap 1.040 -> 1.070, during the tower
    out = long_gap_phases([one[:5], one[5:], two], [(1.0, 1.2)], median_ms=10.0, streams=2)  # one: two requests
    assert out["threshold_ms"] == 25.0 and out["long_gaps"] == 2
    assert out["per_request_and_stream"] == 1.0
    assert out["at_first_token_per_request_and_stream"] == 0.5  # stream one's gap ends with the first token
    assert out["start_after_send_ms"] == {"0": 1, "40": 1}  # starts 10 ms and 40 ms after the send


def test_gaps_before_any_request_and_short_gaps_are_left_out_of_the_bins():
    out = long_gap_phases([[0.0, 0.1, 0.105, 0.11]], [(0.5, 0.6)], median_ms=5.0, streams=1)
    assert out["long_gaps"] == 1 and out["start_after_send_ms"] == {}
    none = long_gap_phases([[0.0, 0.01]], [], median_ms=10.0, streams=1)
    assert none["long_gaps"] == 0 and none["per_request_and_stream"] is None  # no image request in the window
