"""clients/bench_mixed.py: the mixed bench's long gaps placed against the image requests (long_gap_phases),
the window's steps with prompt tokens by path (prompt_steps)."""
from zipmoe.clients.bench_mixed import long_gap_phases, prompt_steps


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


def test_prompt_steps_by_path_over_the_window():
    before = {"zipmoe_prompt_steps_decode_graph_total": 2, "zipmoe_prompt_step_decode_graph_microseconds_total": 20_000}
    after = {"zipmoe_prompt_steps_decode_graph_total": 6, "zipmoe_prompt_step_decode_graph_microseconds_total": 66_000,
             "zipmoe_prompt_steps_eager_total": 0, "zipmoe_prompt_step_eager_microseconds_total": 0,
             "zipmoe_requests_completed_total": 9}
    assert prompt_steps(before, after) == {"decode_graph": {"steps": 4, "mean_ms": 11.5},
                                           "eager": {"steps": 0, "mean_ms": None}}
    assert prompt_steps({}, {}) == {}  # no metrics endpoint
