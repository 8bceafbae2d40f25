"""The mixed-load benches of bench_serving, `mixed` and `mixed_text` (its help says what each
measures): running text streams while image requests, or text prompts as long, arrive; and
`long_gap_phases`, when the streams' long gaps happen relative to those arrivals, so a p99 above
target can be traced to a phase of the requests: image decoding and the tower right after the send,
the prompt step that ends at the request's first token, or elsewhere.

The streams run in threads of this process; the arrivals come from processes of their own (one
per arrival of the window, up to MAX_SENDERS), so building and sending a 30-image request never
delays the streams' timestamps. With `--channel persistent` (the default) each arrival process
opens its gRPC channel and sends one short request on it before the window, so no arrival pays for
a channel or for its process's first request (session 18's run, a channel opened inside each timed
arrival: TTFT p50 321 and p90 861 ms, against 287 / 300 ms from one process in session 16).

`b` is bench_serving's `Bench` (the server's endpoints and the run's arguments).
"""
from __future__ import annotations

import bisect
import math
import multiprocessing
import threading
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor

import numpy as np

from zipmoe.clients.bench_common import QUESTION, STORY, parse_size, pct, row, synthetic_jpeg, timed_stream
from zipmoe.clients.eval_quality import routing_effect
from zipmoe.clients.server_breakdown import diff
from zipmoe.clients.triton_client import ServerError

LONG = 2.5  # a gap is long above this many times the median: the target of issue 13 reads p99 / p50
AT_FIRST_TOKEN_MS = 5.0  # a gap ending this close to an image request's first response ends with its prompt step
BIN_MS = 20
MAX_SENDERS = 32  # arrival processes; each sends one arrival at a time, so one per arrival of the window

_sender: dict = {}  # in an arrival process: the server's URL, the request every arrival sends, the start
# barrier, and its gRPC client (None: a channel per request, --channel per-request)


def _init_sender(url: str, arrival: dict, ready, persistent: bool) -> None:
    import tritonclient.grpc as grpcclient  # imported now, not inside the first timed request

    client = grpcclient.InferenceServerClient(url) if persistent else None
    _sender.update(url=url, arrival=arrival, ready=ready, client=client)


def _send_arrival(tokens: int) -> tuple[float | None, float | None, str | None]:
    """In an arrival process: one request; (send, first response) on perf_counter's clock (the
    system's CLOCK_MONOTONIC, the streams' clock too), or its error. tokens 0: the start-up call, a
    one-token text request on the process's channel, then a wait until every process has made one
    (so each is up, and its channel open, before the window opens)."""
    client = _sender["client"]
    if not tokens:
        if client is not None:
            timed_stream(_sender["url"], client=client, text_input=QUESTION, max_tokens=1)
        _sender["ready"].wait(timeout=300)
        return None, None, None
    try:
        start, times, _ = timed_stream(_sender["url"], client=client, max_tokens=tokens, ignore_eos=True, priority=0,
                                       **_sender["arrival"])
        return start, times[0], None
    except ServerError as e:
        return None, None, f"image request: {e}"


def prompt_tokens(url: str, **inputs) -> int:
    """The decoder's input_token_count for a request (one generated token)."""
    return int(np.asarray(timed_stream(url, max_tokens=1, **inputs)[2]["input_token_count"]).reshape(-1)[0])


def text_as_long_as(url: str, tokens: int) -> str:
    """A text prompt of about `tokens` decoder tokens: STORY repeated, its length measured through the
    server at two repeat counts (the chat template adds a fixed number) and interpolated."""
    one, two = (prompt_tokens(url, text_input=" ".join([STORY] * k)) for k in (1, 2))
    per_story, fixed = two - one, 2 * one - two
    return " ".join([STORY] * max(1, round((tokens - fixed) / per_story)))


def bench_mixed(b, text_only: bool = False) -> list[dict]:
    a = b.args
    images = [synthetic_jpeg(2000 + i, parse_size(a.image_size[0])) for i in range(a.images)]
    arrival = {"text_input": QUESTION, "images": images, "visual_keep_ratio": a.mixed_keep}
    if text_only:  # as many decoder tokens as the image request, without its vision work
        arrival = {"text_input": text_as_long_as(b.url, prompt_tokens(b.url, **arrival))}
    stop, errors = threading.Event(), []
    requests: list[list[list[float]]] = [[] for _ in range(a.streams)]  # per stream, per request: arrivals
    sent: list[tuple[float, float]] = []  # each image request's (send, first response)

    def stream(i: int) -> None:
        while not stop.is_set():
            requests[i].append(times := [])
            try:
                timed_stream(b.url, times, text_input=f"{STORY} ({i})", max_tokens=a.stream_tokens, ignore_eos=True)
            except Exception as e:  # noqa: BLE001 -- counted and reported; the stream starts again
                errors.append(f"{type(e).__name__}: {e}")
                time.sleep(0.1)

    def image_request(outcome) -> None:
        start, first, error = outcome
        if error:
            errors.append(error)
        else:
            sent.append((start, first))

    # The arrivals come from processes of their own, as other clients' requests do: sending 30
    # images from a thread of this process held the interpreter lock while the streams' tokens
    # arrived, and delayed their timestamps. One process per arrival, so none waits for a free one.
    spawn = multiprocessing.get_context("spawn")
    count = min(MAX_SENDERS, max(1, math.ceil(a.duration / a.period)))
    ready = spawn.Barrier(count)
    with ProcessPoolExecutor(count, mp_context=spawn, initializer=_init_sender,
                             initargs=(b.url, arrival, ready, a.channel == "persistent")) as senders:
        for f in [senders.submit(_send_arrival, 0) for _ in range(count)]:
            f.result()
        for _ in range(a.warmup):
            image_request(senders.submit(_send_arrival, a.ttft_tokens).result())
        workers = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(a.streams)]
        for w in workers:
            w.start()
        deadline = time.monotonic() + 600  # the window opens when every stream decodes (or has failed)
        while not all(any(r) for r in requests) and len(errors) < a.streams and time.monotonic() < deadline:
            time.sleep(0.01)
        before, t0 = b.scrape(), time.perf_counter()
        t1 = t0 + a.duration
        futures = []
        while t0 + len(futures) * a.period < t1:
            time.sleep(max(0.0, t0 + len(futures) * a.period - time.perf_counter()))
            futures.append(senders.submit(_send_arrival, a.ttft_tokens))
        time.sleep(max(0.0, t1 - time.perf_counter()))
        stop.set()
        after = b.scrape()
        for f in futures:
            image_request(f.result())
    for w in workers:
        w.join()
    gaps, tpots, tokens, windows = [], [], 0, []
    for times in (times for per_stream in requests for times in per_stream):
        windows.append(inside := [t for t in times if t0 <= t <= t1])
        tokens += len(inside)
        if len(inside) >= 2:
            gaps.extend(np.diff(inside) * 1e3)
            tpots.append((inside[-1] - inside[0]) * 1e3 / (len(inside) - 1))
    in_window = [(s, f) for s, f in sent if t0 <= s <= t1]
    ttfts = [(f - s) * 1e3 for s, f in in_window]  # sent in the window (a late send would meet an idle server)
    what = "a text prompt as long" if text_only else f"{a.images} images"
    return [row("mixed_text" if text_only else "mixed", a.mixed_keep, b.routing, concurrency=a.streams,
                images=0 if text_only else a.images, n=len(ttfts),
                ttft=ttfts, tpot=tpots, itl=gaps, tokens_per_s=tokens / a.duration, itl_ms_p50=pct(gaps, 50),
                itl_ms_quantiles=np.percentile(gaps, range(101)).tolist() if gaps else None,
                long_gaps=long_gap_phases(windows, in_window, pct(gaps, 50), a.streams) if gaps else None,
                image_requests=len(futures), failed=len(errors), first_error=errors[0] if errors else None,
                preemptions=diff(before, after, "zipmoe_preemptions_total"),
                gpu_turn_waits=diff(before, after, "zipmoe_gpu_turn_waits_total"),
                gc_full_collections=diff(before, after, "zipmoe_gc_full_collections_total"),
                gc_pause_us=diff(before, after, "zipmoe_gc_pause_microseconds_total"),
                prompt_steps=prompt_steps(before, after),
                experts_read=routing_effect(before, after)["experts_read"] if after else None,
                image_size=a.image_size[0], channel=a.channel, note=f"{a.streams} streams + {what} every {a.period:g} s")]



PROMPT_STEPS = "zipmoe_prompt_steps_"


def prompt_steps(before: dict, after: dict) -> dict:
    """The window's steps with prompt tokens by how moe_decoder ran them (engine/runner.py's paths, as
    its zipmoe_prompt_steps_<path>_total metrics name them): {path: {steps, mean_ms}} (mean_ms None
    without a step)."""
    out = {}
    for path in sorted(m[len(PROMPT_STEPS):-len("_total")] for m in after if m.startswith(PROMPT_STEPS)):
        n = diff(before, after, f"zipmoe_prompt_steps_{path}_total")
        us = diff(before, after, f"zipmoe_prompt_step_{path}_microseconds_total")
        out[path] = {"steps": n, "mean_ms": round(us / n / 1e3, 2) if n and us is not None else None}
    return out


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
