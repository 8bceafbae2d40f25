"""image_decode's DALI graph outside Triton: images/s for each way of decoding JPEGs on the GPU.

    python -m zipmoe.kernels.benchmarks.bench_image_decode [--images 64] [--size 1024x768] [--out PREFIX]

Through the server on the H200, `image_decode` turned 64 JPEGs of 1024x768 per request into pixel
values at 1,070-1,272 images/s (Triton's compute time, docs/PERFORMANCE.md), where DALI alone had
reached 5,800/s with the hardware decoder. This replays the model's work, fed one request at a
time as the model feeds it (`image_pipeline.image_pipeline`: decode, smart resize, bicubic resize,
normalise; and the header pass that guards it), for each `DecoderOptions` (chroma upsampling like
libjpeg or not, the hardware decoder's share), and the decode alone, so the gap splits between the
decoding choices and the rest of the graph. Each row: the median of --reps runs after two warm-ups,
the device synchronised after each. On a CPU it times the CPU graph once (no options apply).
Writes OUT.json {device, images, size, rows: [{part, fancy_upsampling, hw_decoder_load, ms, images_per_s}]}.
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path

import numpy as np
import nvidia.dali.fn as fn
import nvidia.dali.types as types
import torch
from nvidia.dali import pipeline_def

from zipmoe.clients.bench_common import parse_size, synthetic_jpeg
from zipmoe.image_pipeline import INPUT_NAME, DecoderOptions, ImageConfig, header_pipeline, image_pipeline
from zipmoe.serve import REAL_SHAPE_CHECKPOINT

from .timing import wall_ms, write_result

HW_DECODER_LOADS = (0.65, 0.9, 1.0)


def decode_only(batch_size: int, threads: int, device_id: int | None, decoder: DecoderOptions):
    """The decoder alone, as "DALI alone" was measured: encoded bytes -> RGB, nothing after."""
    gpu = device_id is not None

    @pipeline_def(batch_size=batch_size, num_threads=threads, device_id=device_id, prefetch_queue_depth=1)
    def pipe():
        encoded = fn.external_source(name=INPUT_NAME, dtype=types.UINT8, device="cpu")
        extra = {"hw_decoder_load": decoder.hw_decoder_load} if gpu else {}
        return fn.decoders.image(encoded, device="mixed" if gpu else "cpu", output_type=types.RGB,
                                 jpeg_fancy_upsampling=decoder.fancy_upsampling or not gpu, **extra)

    return pipe()


def run_ms(pipe, images: list[np.ndarray], reps: int, gpu: bool) -> float:
    """Median wall milliseconds of one fed run, as the model feeds it (two warm-up runs first)."""
    pipe.build()

    def run():
        pipe.feed_input(INPUT_NAME, images)
        pipe.run()

    return wall_ms(run, gpu, reps, warmup=2)


def bench(images: list[np.ndarray], cfg: ImageConfig, device_id: int | None, reps: int) -> list[dict]:
    gpu, threads, n = device_id is not None, min(8, os.cpu_count() or 1), len(images)
    options = ([DecoderOptions(fancy, load) for fancy in (True, False) for load in HW_DECODER_LOADS]
               if gpu else [DecoderOptions()])
    parts = [("header pass", None, lambda o: header_pipeline(batch_size=n, num_threads=threads))]
    parts += [("decode only", o, lambda o: decode_only(n, threads, device_id, o)) for o in options]
    parts += [("pipeline", o, lambda o: image_pipeline(cfg, batch_size=n, num_threads=threads, device_id=device_id,
                                                        gpu=gpu, decoder=o)) for o in options]
    rows = []
    for part, option, make in parts:
        ms = run_ms(make(option), images, reps, gpu)
        rows.append({"part": part, "fancy_upsampling": None if option is None or not gpu else option.fancy_upsampling,
                     "hw_decoder_load": None if option is None or not gpu else option.hw_decoder_load,
                     "ms": round(ms, 3), "images_per_s": round(n / ms * 1e3, 1)})
        settings = ("" if option is None or not gpu
                    else f"fancy {option.fancy_upsampling!s:5}  hw {option.hw_decoder_load:.2f}")
        print(f"{part:12s} {settings:24s} {ms:8.2f} ms  {rows[-1]['images_per_s']:8.1f} images/s", flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--images", type=int, default=64, help="JPEGs per request (one DALI batch)")
    ap.add_argument("--size", default="1024x768", help="WIDTHxHEIGHT of every JPEG")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--checkpoint", default=str(REAL_SHAPE_CHECKPOINT), help="its preprocessor_config.json")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    device_id = torch.cuda.current_device() if torch.cuda.is_available() else None
    size = parse_size(args.size)
    images = [np.frombuffer(synthetic_jpeg(seed, size), np.uint8) for seed in range(args.images)]
    rows = bench(images, ImageConfig.from_checkpoint(args.checkpoint), device_id, args.reps)
    if args.out:
        name = torch.cuda.get_device_name() if device_id is not None else "cpu"
        write_result(args.out, {"device": name, "images": args.images, "size": args.size, "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
