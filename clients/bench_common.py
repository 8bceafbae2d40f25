"""What the load clients share (bench_serving, bench_mixed, bench_degradation, soak, perf_analyzer
inputs): seeded synthetic JPEGs, size and percentile helpers, the device a run is measured on, and
the serving benches' prompts, timed stream and result row.
"""
from __future__ import annotations

import io
import json
import subprocess
import sys
import time

import numpy as np

from zipmoe.clients.triton_client import grpc_generate

QUESTION = "What do these pictures show? Answer briefly."
STORY = "Tell me a long story about a lighthouse keeper and the ships she saw."


def synthetic_jpeg(seed: int, size: tuple[int, int], quality: int = 90) -> bytes:
    """A seeded, detailed picture (colour gradient, grain, blocks, lines of random text): it
    compresses like a photo of a document, not like a flat test card."""
    from PIL import Image, ImageDraw

    w, h = size
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    slope = rng.uniform(-80, 80, (2, 3))
    pixels = rng.uniform(60, 200, 3) + (x / w)[..., None] * slope[0] + (y / h)[..., None] * slope[1]
    image = Image.fromarray(np.clip(pixels + rng.normal(0, 12, (h, w, 3)), 0, 255).astype(np.uint8))
    draw = ImageDraw.Draw(image)
    for _ in range(max(2, w * h // 30000)):
        x0, y0 = int(rng.integers(0, w)), int(rng.integers(0, h))
        draw.rectangle([x0, y0, x0 + int(rng.integers(4, w // 4 + 5)), y0 + int(rng.integers(4, h // 4 + 5))],
                       fill=tuple(int(c) for c in rng.integers(0, 256, 3)))
    chars = np.array(list("abcdefghijklmnopqrstuvwxyz0123456789   $.,:"))
    for top in range(2, h - 10, 14):
        draw.text((3, top), "".join(rng.choice(chars, w // 6)), fill=(0, 0, 0) if rng.random() < 0.8 else (255,) * 3)
    buf = io.BytesIO()
    image.save(buf, format="JPEG", quality=quality)
    return buf.getvalue()


def parse_size(text: str) -> tuple[int, int]:
    w, _, h = text.lower().partition("x")
    return int(w), int(h)


def pct(values, q: float) -> float | None:
    return float(np.percentile(values, q)) if len(values) else None


def rounded(v):
    if isinstance(v, (dict, list)):
        return {k: rounded(x) for k, x in v.items()} if isinstance(v, dict) else [rounded(x) for x in v]
    return round(v, 3) if isinstance(v, float) else v


def device_info() -> tuple[str, float | None]:
    """(device name or "cpu", copy bandwidth in GB/s), from a child process: the server gets the GPU whole."""
    code = ("import json, torch\nif torch.cuda.is_available():\n"
            "    from zipmoe.kernels.benchmarks.timing import copy_gbps\n"
            "    print(json.dumps([torch.cuda.get_device_name(), round(copy_gbps(), 1)]))\n"
            "else:\n    print(json.dumps(['cpu', None]))")
    out = subprocess.run([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, check=True).stdout
    return tuple(json.loads(out.strip().splitlines()[-1]))


def row(bench: str, keep_ratio=None, routing=None, concurrency=1, images=0, n=0, ttft=(), tpot=(), itl=(),
        tokens_per_s=None, images_per_s=None, **extra) -> dict:
    """One row of bench_serving's result: the issue's keys (percentiles of the ms lists given), then extra keys."""
    return rounded({"bench": bench, "keep_ratio": keep_ratio, "routing": routing, "concurrency": concurrency,
                    "images": images, "n": n, "ttft_ms_p50": pct(ttft, 50), "ttft_ms_p90": pct(ttft, 90),
                    "tpot_ms_p50": pct(tpot, 50), "tpot_ms_p90": pct(tpot, 90), "itl_ms_p99": pct(itl, 99),
                    "tokens_per_s": tokens_per_s, "images_per_s": images_per_s, **extra})


def timed_stream(url: str, times: list | None = None, client=None, **inputs) -> tuple[float, list[float], dict]:
    """One streamed request: (send time, arrival of each response, last response), perf_counter clock.
    `times` is filled as responses arrive, so another thread can watch it. client: an open gRPC client
    (grpc_generate) whose channel the request reuses; None opens one inside the timed span."""
    times, last, start = [] if times is None else times, {}, time.perf_counter()
    for last in grpc_generate(url, stream=True, client=client, **inputs):
        times.append(time.perf_counter())
    return start, times, last
