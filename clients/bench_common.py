"""What the load clients share (bench_serving, bench_degradation, soak, perf_analyzer inputs):
seeded synthetic JPEGs, size and percentile helpers, and the device a run is measured on.
"""
from __future__ import annotations

import io
import json
import subprocess
import sys

import numpy as np


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
