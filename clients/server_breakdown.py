"""Where a benchmark's requests spent their time inside the server, from what it exports: Triton's
cumulative per-model statistics (HTTP /v2/models/M/stats) and our own counters (the metrics
endpoint, `triton_client.scrape_metrics`), read before and after a run of requests on an idle
server and turned into per-request milliseconds. Used by `bench_serving`.
"""
from __future__ import annotations

import json
import time
import urllib.request

STAGES = ("preprocess", "image_decode", "vision_encoder", "postprocess")  # Triton statistics read
IMAGE_DECODE_PHASES = {p: f"zipmoe_image_decode_{p}_microseconds_total" for p in ("input", "check", "pipeline", "output")}
IMAGE_DECODE_REQUESTS = "zipmoe_image_decode_requests_total"
VISION = {"vision_forward": "zipmoe_vision_forward_microseconds_total",
          "visionzip": "zipmoe_visionzip_microseconds_total"}


def model_stats(http: str, model: str) -> dict[str, list[int]]:
    """Triton's cumulative statistics of a model: {kind: [count, ns]} (success, queue, compute_*)."""
    out: dict[str, list[int]] = {}
    with urllib.request.urlopen(f"http://{http}/v2/models/{model}/stats", timeout=10) as r:
        for version in json.loads(r.read())["model_stats"]:
            for kind, v in version["inference_stats"].items():
                count, ns = out.get(kind, (0, 0))
                out[kind] = [count + int(v["count"]), ns + int(v["ns"])]
    return out


def diff(before: dict, after: dict, name: str) -> float | None:
    return after[name] - before.get(name, 0.0) if name in after else None


def settled(read):
    """read() once two reads 50 ms apart agree: Triton and our counters count a request after its
    last response has left, so a read right after the client has it can miss it (idle server only)."""
    last, deadline = None, time.monotonic() + 5
    while (now := read()) != last and time.monotonic() < deadline:
        last = now
        time.sleep(0.05)
    return now


def breakdown(before: dict, after: dict, n: int) -> tuple[dict, dict]:
    """Per-request server times (ms) between two snapshots around n requests: compute and queue."""
    compute, queue = {}, {}
    for m in STAGES:
        b, a = before["stats"][m], after["stats"][m]
        compute[m] = (a["compute_infer"][1] - b["compute_infer"][1]) / n / 1e6 if a and b else None
        queue[m] = (a["queue"][1] - b["queue"][1]) / n / 1e6 if a and b else None
    mb, ma = before["metrics"], after["metrics"]
    vision_requests = diff(mb, ma, "zipmoe_vision_requests_total") or n
    for key, name in VISION.items():
        compute[key] = None if name not in ma else diff(mb, ma, name) / vision_requests / 1e3
    done, ttft_us = diff(mb, ma, "zipmoe_requests_completed_total"), diff(mb, ma, "zipmoe_ttft_microseconds_total")
    compute["decoder_ttft"] = ttft_us / done / 1e3 if done and ttft_us is not None else None
    return compute, queue


def decode_phases(before: dict, after: dict, compute_ms: float | None) -> dict | None:
    """image_decode's own counters per request (ms); `response`: Triton's compute time beyond them."""
    requests = diff(before, after, IMAGE_DECODE_REQUESTS)
    if not requests:
        return None
    phases = {p: round(diff(before, after, name) / requests / 1e3, 3) for p, name in IMAGE_DECODE_PHASES.items()}
    if compute_ms is not None:
        phases["response"] = round(compute_ms - sum(phases.values()), 3)
    return phases
