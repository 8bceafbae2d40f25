"""perf_analyzer's `--profile-export-file` JSON -> per-request latencies -> one result row per experiment.

The export (perf_analyzer 2.51) is {experiments: [{experiment: {mode, value}, requests: [...],
window_boundaries}], version, service_kind, endpoint}; each request has `timestamp` (send, ns since
the epoch), `request_inputs`, `response_timestamps` (ns) and `response_outputs` (each response's
outputs, decoded). Conventions are bench_serving's, so the two benchmarks' numbers compare:

  TTFT   first token response - send
  TPOT   (last token response - first) / (output tokens - 1), per request
  ITL    gaps between a request's consecutive token responses (all requests pooled)
  out_tok_s, req_s   output tokens / completed requests of the run over its span (first send to
                     last response)

A token response is one whose `output_token_count` goes up by one from the response before (the
server streams one response per token). That drops an empty final response (a cancelled
mm_qa_bls request ends with one), which perf_analyzer 2.51 records with uninitialised outputs. A request is complete when its last
token response carries a finish_reason and, with ignore_eos, exactly max_tokens tokens; every
other request counts as an error. Percentiles are numpy's (linear), as in bench_serving.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from zipmoe.clients.bench_common import pct, rounded

NS_PER_MS = 1e6


@dataclass
class RequestTimes:
    """One request as the export recorded it; times in ns since the epoch."""
    sent: int
    token_times: list[int] = field(default_factory=list)  # arrival of each token response
    tokens: int = 0  # output_token_count of the last token response
    complete: bool = False

    @property
    def ttft_ms(self) -> float:
        return (self.token_times[0] - self.sent) / NS_PER_MS

    @property
    def tpot_ms(self) -> float | None:
        return (self.token_times[-1] - self.token_times[0]) / NS_PER_MS / (self.tokens - 1) if self.tokens > 1 else None

    @property
    def e2e_ms(self) -> float:
        return (self.token_times[-1] - self.sent) / NS_PER_MS

    def gaps_ms(self) -> list[float]:
        return (np.diff(self.token_times) / NS_PER_MS).tolist()


def load(path: Path) -> dict:
    """The export as a dict. BYTES inputs (the images) are written as raw bytes inside JSON strings,
    so the file is not valid UTF-8: undecodable bytes are kept as surrogates and control characters
    allowed (strict=False), never an error."""
    return json.loads(Path(path).read_bytes().decode("utf-8", "surrogateescape"), strict=False)


def scalar(value):
    """A 1-element tensor as the export writes it: the value itself, or a list of one."""
    return value[0] if isinstance(value, list) and len(value) == 1 else value


def request_times(request: dict) -> RequestTimes:
    inputs = request.get("request_inputs") or {}
    max_tokens, ignore_eos = scalar(inputs.get("max_tokens")), scalar(inputs.get("ignore_eos"))
    times = RequestTimes(sent=int(request["timestamp"]))
    finish = ""
    for stamp, outputs in zip(request.get("response_timestamps", []), request.get("response_outputs", [])):
        count = scalar(outputs.get("output_token_count"))
        if not isinstance(count, int) or count != times.tokens + 1:
            break  # not a token response (the empty final one), nothing after it is either
        if isinstance(max_tokens, int) and count > max_tokens:
            break
        times.token_times.append(int(stamp))
        times.tokens, finish = count, scalar(outputs.get("finish_reason"))
    exact = not ignore_eos or not isinstance(max_tokens, int) or times.tokens == max_tokens
    times.complete = bool(times.token_times) and isinstance(finish, str) and bool(finish) and exact
    return times


def summarise(requests: list[RequestTimes], asked: int | None = None) -> dict:
    """The row's measured part. `asked`: the run's --request-count. perf_analyzer's sending threads
    count on their own, so at a rate it may send a few more: the first `asked` by send time are the
    run (`sent` says how many went), and those that never came back count as errors too."""
    measured = sorted(requests, key=lambda r: r.sent)[:asked] if asked else requests
    done = [r for r in measured if r.complete]
    errors = (asked or len(requests)) - len(done)
    ttft = [r.ttft_ms for r in done]
    tpot = [t for t in (r.tpot_ms for r in done) if t is not None]
    itl = [g for r in done for g in r.gaps_ms()]
    e2e = [r.e2e_ms for r in done]
    span_s = (max(r.token_times[-1] for r in done) - min(r.sent for r in done)) / 1e9 if done else 0.0
    sends = sorted(r.sent for r in measured)
    return rounded({
        "n": len(done), "errors": errors,
        **{f"ttft_ms_p{q}": pct(ttft, q) for q in (50, 90, 99)},
        **{f"tpot_ms_p{q}": pct(tpot, q) for q in (50, 90, 99)},
        **{f"itl_ms_p{q}": pct(itl, q) for q in (50, 90, 99)},
        "e2e_ms_p50": pct(e2e, 50), "e2e_ms_p99": pct(e2e, 99),
        "out_tok_s": sum(r.tokens for r in done) / span_s if span_s > 0 else None,
        "req_s": len(done) / span_s if span_s > 0 else None,
        "sent_per_s": (len(sends) - 1) / ((sends[-1] - sends[0]) / 1e9) if len(sends) > 1 and sends[-1] > sends[0]
        else None,
        "output_tokens": sum(r.tokens for r in done), "sent": len(requests),
    })


def experiments(export: dict) -> list[tuple[str, float, list[RequestTimes]]]:
    """(mode "concurrency" | "rate", value, requests) of each experiment in an export."""
    out = []
    for e in export.get("experiments", []):
        mode = "rate" if e["experiment"]["mode"] == "request_rate" else "concurrency"
        value = e["experiment"]["value"]
        out.append((mode, int(value) if mode == "concurrency" else float(value),
                    [request_times(r) for r in e.get("requests", [])]))
    return out
