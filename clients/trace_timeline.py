"""Where an ensemble request's time goes between and inside its models, from Triton's own trace.

    python -m zipmoe.clients.trace_timeline PREFIX [--model mm_qa]

Triton writes traces when tritonserver starts with `server_args(PREFIX)` (level TIMESTAMPS, every
request, PREFIX.0, PREFIX.1, ... as they complete; the file cannot be set later through the trace
API). Each request of the ensemble `--model` is one trace; each step it runs is a child trace
(`parent_id`) with REQUEST_START, QUEUE_START, COMPUTE_START, COMPUTE_INPUT_END,
COMPUTE_OUTPUT_START, COMPUTE_END and REQUEST_END. `segments` turns one request into consecutive
spans from the ensemble's arrival to the end of its first response's last step (the first token,
for mm_qa): `A>B` the hand-off from step A's end to step B's start (the ensemble's routing and the
Python backend's IPC), then per step `wait` (queue and scheduling), `input` (the inputs into the
stub), `execute` (the model's own execute), `output` (its response back) and `release`. For a
decoupled step (moe_decoder) `execute` returns at once and its first response's time shows up as
the hand-off to the next step. `bench_serving --trace` puts the medians of a run into its rows.
Timestamps are CLOCK_MONOTONIC nanoseconds, the clock of `time.monotonic_ns()` on the same host.
"""
from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path

PHASES = (("wait", "REQUEST_START", "COMPUTE_START"), ("input", "COMPUTE_START", "COMPUTE_INPUT_END"),
          ("execute", "COMPUTE_INPUT_END", "COMPUTE_OUTPUT_START"), ("output", "COMPUTE_OUTPUT_START", "COMPUTE_END"),
          ("release", "COMPUTE_END", "REQUEST_END"))


def server_args(prefix: Path) -> list[str]:
    """tritonserver flags that trace every request at TIMESTAMPS level into PREFIX.N files."""
    return [f"--trace-config=triton,file={prefix}", "--trace-config=triton,log-frequency=1",
            "--trace-config=level=TIMESTAMPS", "--trace-config=rate=1", "--trace-config=count=-1"]


def read(prefix: Path) -> dict[int, dict]:
    """Every trace in PREFIX and PREFIX.N: {id: {"model", "parent", "ts": {event: ns}}}."""
    traces: dict[int, dict] = defaultdict(lambda: {"model": None, "parent": None, "ts": {}})
    files = [prefix] + sorted(prefix.parent.glob(prefix.name + ".*"))
    for path in files:
        if not path.is_file():
            continue
        try:
            entries = json.loads(path.read_text())
        except json.JSONDecodeError:  # a file Triton is still writing; read again later
            continue
        for e in entries:
            t = traces[e["id"]]
            if "model_name" in e:
                t["model"], t["parent"] = e["model_name"], e.get("parent_id")
            for stamp in e.get("timestamps", ()):
                t["ts"].setdefault(stamp["name"], stamp["ns"])  # a name repeats per response: keep the first
    return dict(traces)


def requests(traces: dict[int, dict], model: str = "mm_qa", since_ns: int = 0, until_ns: int | None = None) -> list[dict]:
    """The requests of `model` that arrived in [since_ns, until_ns], each {"ts", "steps": [child traces
    by start]}; only requests whose steps all finished. A model that is no ensemble is its own one step."""
    children = defaultdict(list)
    for t in traces.values():
        if t["parent"] is not None:
            children[t["parent"]].append(t)
    out = []
    for tid, t in traces.items():
        start = t["ts"].get("REQUEST_START")
        if t["model"] != model or start is None or start < since_ns or (until_ns is not None and start > until_ns):
            continue
        steps = sorted(children.get(tid, ()), key=lambda c: c["ts"].get("REQUEST_START", 0)) or [t]
        if steps and all("REQUEST_END" in c["ts"] for c in steps):
            out.append({"ts": t["ts"], "steps": steps})
    return out


def segments(request: dict) -> dict[str, float]:
    """Consecutive spans (ms) from the ensemble's arrival to the end of its first response's last step.
    A model that runs once per response (mm_qa's postprocess) counts with its first run only."""
    spans: dict[str, float] = {}
    seen, previous, end = set(), "arrival", request["ts"]["REQUEST_START"]
    for step in request["steps"]:
        name, ts = step["model"], step["ts"]
        if name in seen:
            continue
        seen.add(name)
        spans[f"{previous}>{name}"] = (ts["REQUEST_START"] - end) / 1e6
        for phase, a, b in PHASES:
            if a in ts and b in ts:
                spans[f"{name}.{phase}"] = (ts[b] - ts[a]) / 1e6
        previous, end = name, ts["REQUEST_END"]
    spans["total"] = (end - request["ts"]["REQUEST_START"]) / 1e6
    return spans


def median_segments(reqs: list[dict]) -> dict[str, float]:
    """Each span's median over the requests (medians need not add up to the median total)."""
    per = [segments(r) for r in reqs]
    keys = list(dict.fromkeys(k for p in per for k in p))
    return {k: round(statistics.median(p[k] for p in per if k in p), 3) for k in keys}


def longest(spans: dict[str, float], k: int) -> list[tuple[str, float]]:
    """The k longest spans, the total left out."""
    return sorted(((name, ms) for name, ms in spans.items() if name != "total"), key=lambda kv: -kv[1])[:k]


def format_segments(spans: dict[str, float]) -> str:
    """One line per span, in order, then the total."""
    return "\n".join(f"  {v:9.2f} ms  {k}" for k, v in spans.items() if k != "total") + \
        f"\n  {spans.get('total', 0.0):9.2f} ms  total"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("prefix", type=Path, help="the trace file tritonserver was started with")
    ap.add_argument("--model", default="mm_qa", help="the model (an ensemble: its steps too) whose requests to read")
    args = ap.parse_args(argv)
    reqs = requests(read(args.prefix), args.model)
    if not reqs:
        print(f"no finished {args.model} requests in {args.prefix}*")
        return 1
    print(f"{len(reqs)} {args.model} requests, median of each span:")
    print(format_segments(median_segments(reqs)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
