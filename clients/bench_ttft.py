"""TTFT of a many-image request through mm_qa at several visual keep ratios.

    python -m zipmoe.clients.bench_ttft [--url HOST:PORT] [--images 30] [--keep 1.0 0.6] [--out FILE.json]

Without --url it starts its own server on the tiny checkpoint. Prints a table and writes JSON.
"""
from __future__ import annotations

import argparse
import io
import json
import statistics
import time
from pathlib import Path

import torch
from PIL import Image, ImageDraw

from zipmoe.clients.triton_client import grpc_generate


def note_jpeg(i: int, size=(448, 288)) -> bytes:
    """A deterministic 'note' photo: text lines on a tinted background. 448x288 is 126 visual tokens, so
    30 of them (3,780) fit the tiny checkpoint's 4,096-token context unpruned."""
    img = Image.new("RGB", size, (200 + 5 * (i % 10), 190, 170 + 7 * (i % 8)))
    draw = ImageDraw.Draw(img)
    for row in range(10):
        draw.text((16, 12 + 27 * row), f"note {i} line {row}: item {(i * 7 + row) % 97} costs {i + row}.50", fill="black")
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def ttft_ms(url: str, images: list[bytes], keep: float) -> tuple[float, list[int]]:
    start = time.perf_counter()
    first, kept = None, []
    for r in grpc_generate(url, stream=True, text_input="What do these notes say?", images=images, max_tokens=4,
                           ignore_eos=True, visual_keep_ratio=keep):
        if first is None:
            first = (time.perf_counter() - start) * 1e3
            kept = r["visual_tokens_kept"]
    return first, kept


def run(url: str, n_images: int, keeps: list[float], repeats: int) -> list[dict]:
    images = [note_jpeg(i) for i in range(n_images)]
    rows = []
    for keep in keeps:
        for _ in range(2):  # warm-up: first requests of a new shape are slow
            ttft_ms(url, images, keep)
        times, kept = [], []
        for _ in range(repeats):
            t, kept = ttft_ms(url, images, keep)
            times.append(t)
        rows.append({"images": n_images, "keep_ratio": keep, "visual_tokens": sum(kept),
                     "ttft_ms_median": statistics.median(times), "ttft_ms_min": min(times), "runs": repeats})
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", help="gRPC host:port of a running server (default: start one)")
    p.add_argument("--images", type=int, default=30)
    p.add_argument("--keep", type=float, nargs="+", default=[1.0, 0.6])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    if args.url:
        rows = run(args.url, args.images, args.keep, args.repeats)
    else:
        from zipmoe import serve
        from zipmoe.build.tiny_checkpoint import build_tiny_checkpoint

        ports = [serve.free_port() for _ in range(3)]
        checkpoint = build_tiny_checkpoint(serve.TINY_CHECKPOINT)
        with serve.TritonServer(serve.DEFAULT_REPOSITORY, *ports, checkpoint=str(checkpoint),
                                log_path=Path("/tmp/zipmoe-bench-server.log")) as server:
            server.wait_ready()
            rows = run(server.url_grpc, args.images, args.keep, args.repeats)
    print(f"{'images':>6} {'keep':>5} {'visual tokens':>13} {'TTFT median ms':>15} {'min ms':>8}   ({device})")
    for r in rows:
        print(f"{r['images']:>6} {r['keep_ratio']:>5.2f} {r['visual_tokens']:>13} {r['ttft_ms_median']:>15.1f} "
              f"{r['ttft_ms_min']:>8.1f}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"device": device, "checkpoint": "tiny", "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
