"""VisionZip for one many-image request outside the server: where vision_encoder's VisionZip time goes.

    python -m zipmoe.kernels.benchmarks.bench_visionzip --out docs/results/visionzip_h200 [--profile]

Through the server on the H200, vision_encoder spent 10.6 ms in VisionZip at keep 1.0 for 30
images of 512x512, 37.8 ms at keep 0.6 and 25.8 ms at 0.4 (docs/PERFORMANCE.md, the zipmoe_visionzip
metric: selection, folding and building the response). This replays the same work without Triton:
features shaped as the 30B-A3B vision tower leaves them (`vision.VisionEncoder.features`: merged
tokens of width out_hidden_size and the DeepStack layers on the device in bf16; importance and
head-averaged keys of the vision head width on the host), random but fixed. Per keep ratio, the
median wall time, with the device synchronised before and after each call, of:
- select_tokens: the budget split and each image's choice, on the host;
- compress: select_tokens plus folding the embeddings and DeepStack features on the device;
- compress + decoder_inputs: plus the bf16 copies and index arrays the response carries.
If these stay far below the server's figure, the time is in the Python backend's response path.
With --profile, torch.profiler's busiest operators at keep 0.6 go to the log.
Writes OUT.json {device, images, tokens_per_image, rows: [{keep_ratio, part, ms}]}.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from zipmoe.serve import REAL_SHAPE_CHECKPOINT
from zipmoe.visionzip import ImageFeatures, compress, decoder_inputs, select_tokens

from .timing import wall_ms, write_result

KEEP_RATIOS = (1.0, 0.6, 0.4)


def make_features(images: int, tokens: int, width: int, layers: int, key_dim: int, device: str,
                  seed: int = 0) -> list[ImageFeatures]:
    """`images` square images of `tokens` merged tokens each; importance skewed within an image and
    summing to 4 x tokens (2x2 merger), as weigh_images leaves it under size weighting."""
    g = torch.Generator().manual_seed(seed)
    side = int(tokens ** 0.5)
    feats = []
    for _ in range(images):
        importance = torch.rand(tokens, generator=g) ** 4
        feats.append(ImageFeatures(
            embeds=torch.randn(tokens, width, generator=g).to(device, torch.bfloat16),
            deepstack=torch.randn(layers, tokens, width, generator=g).to(device, torch.bfloat16),
            importance=importance * (4 * tokens / importance.sum()),
            keys=torch.randn(tokens, key_dim, generator=g), grid=(side, tokens // side)))
    return feats


def bench(feats: list[ImageFeatures], device: str, reps: int, keep_ratios=KEEP_RATIOS) -> list[dict]:
    width, layers = feats[0].embeds.shape[1], feats[0].deepstack.shape[0]
    parts = {
        "select_tokens": lambda r: select_tokens([f.importance for f in feats], [f.keys for f in feats], r),
        "compress": lambda r: compress(feats, r),
        "compress + decoder_inputs": lambda r: decoder_inputs(compress(feats, r), width, layers),
    }
    rows = []
    for keep in keep_ratios:
        for part, fn in parts.items():
            rows.append({"keep_ratio": keep, "part": part,
                         "ms": round(wall_ms(lambda: fn(keep), device == "cuda", reps), 3)})
            print(f"keep {keep:.1f}  {part:26s} {rows[-1]['ms']:8.2f} ms", flush=True)
    return rows


def profile(feats: list[ImageFeatures], device: str, keep: float = 0.6) -> None:
    width, layers = feats[0].embeds.shape[1], feats[0].deepstack.shape[0]
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if device == "cuda" else [])
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(5):
            decoder_inputs(compress(feats, keep), width, layers)
        if device == "cuda":
            torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--images", type=int, default=30)
    ap.add_argument("--tokens", type=int, default=256, help="merged tokens per image (512x512: 256)")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    vision = json.loads((REAL_SHAPE_CHECKPOINT / "config.json").read_text())["vision_config"]
    feats = make_features(args.images, args.tokens, vision["out_hidden_size"], len(vision["deepstack_visual_indexes"]),
                          vision["hidden_size"] // vision["num_heads"], args.device)
    rows = bench(feats, args.device, args.reps)
    if args.profile:
        profile(feats, args.device)
    if args.out:
        name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
        write_result(args.out, {"device": name, "images": args.images, "tokens_per_image": args.tokens, "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
