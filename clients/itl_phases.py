"""Where the running streams' long gaps fall, for `bench_serving`'s mixed bench.

bench_serving's `mixed` row says how long the streams' inter-token gaps are (p50, p99); this says
when the long ones happen relative to the image requests that arrive meanwhile, so that a p99 above
target can be traced to a phase of those requests: image decoding and the tower right after the
send, the prompt step that ends at the request's first token, or elsewhere.

Input: each stream's response times and each image request's (send, first response) times, one
clock (perf_counter seconds). Output: the `long_gaps` dict of the row (see `long_gap_phases`).
"""
from __future__ import annotations

import bisect
from collections import Counter

LONG = 2.5  # a gap is long above this many times the median: the target of issue 13 reads p99 / p50
AT_FIRST_TOKEN_MS = 5.0  # a gap ending this close to an image request's first response ends with its prompt step
BIN_MS = 20


def long_gap_phases(responses: list[list[float]], requests: list[tuple[float, float]], median_ms: float,
                    streams: int) -> dict:
    """responses: per stream request (a stream sends one after another), its responses' arrival
    times inside the window; requests: (send, first response) of each image request; streams: how
    many streams ran. Returns {threshold_ms, long_gaps, per_request_and_stream,
    at_first_token_per_request_and_stream (the long gaps that end within AT_FIRST_TOKEN_MS of a
    request's first response), start_after_send_ms ({bin start: long gaps whose start lies that many
    ms after the last send before it, in BIN_MS bins}; gaps that start before any send are left out
    of the bins)}."""
    threshold = LONG * median_ms
    sends = sorted(s for s, _ in requests)
    firsts = sorted(f for _, f in requests)
    long_gaps, at_first, bins = 0, 0, Counter()
    for times in responses:
        for begin, end in zip(times, times[1:]):
            if (end - begin) * 1e3 <= threshold:
                continue
            long_gaps += 1
            k = bisect.bisect_left(firsts, end - AT_FIRST_TOKEN_MS / 1e3)
            if k < len(firsts) and firsts[k] <= end + AT_FIRST_TOKEN_MS / 1e3:
                at_first += 1
            last_send = bisect.bisect_right(sends, begin) - 1
            if last_send >= 0:
                bins[int((begin - sends[last_send]) * 1e3 // BIN_MS) * BIN_MS] += 1
    per = len(requests) * streams
    return {"threshold_ms": round(threshold, 3), "long_gaps": long_gaps,
            "per_request_and_stream": round(long_gaps / per, 3) if per else None,
            "at_first_token_per_request_and_stream": round(at_first / per, 3) if per else None,
            "start_after_send_ms": {str(k): bins[k] for k in sorted(bins)}}
