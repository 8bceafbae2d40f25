"""perf_analyzer `--input-data` JSON for mm_qa / mm_qa_bls: fixed workloads and the business mix.

    python -m perf_analyzer_configs.make_inputs [--profile ci|full] [--workload NAME ...] [--entries N]
        [--seed S] [--out-dir DIR]

Workloads: `text` (no image), `img1`, `img8`, `img30` (that many images per request, `tokens` answer
tokens) and `business`, the mix the seed's decode result was measured on: 1-30 images per request
(IMAGE_BUCKETS) and answers of 64-256 tokens (uniform). README.md says why that distribution.
Every request streams (`stream` true) and stops after exactly `max_tokens` tokens (`ignore_eos`
true), so TPOT does not depend on when a random model happens to emit EOS.

Profiles: `ci` writes the small files committed in perf_analyzer_configs/inputs/ (64x64 JPEGs,
short answers, a few entries: the CPU test and examples); `full` is what the H200 runs use
(512x512 JPEGs, the seed's answer lengths, 250 business entries), generated into
perf_analyzer_configs/.work/inputs/full/ at run time (hundreds of MB: not committed).

Images are `bench_common.synthetic_jpeg` pictures, each request's own (distinct seeds), so an
entry never hits mm_qa_bls's feature cache on its first use. perf_analyzer cycles through the
entries when it sends more requests than there are; mm_qa has no cache, so a repeat costs the same.
"""
from __future__ import annotations

import argparse
import base64
import json
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

FOLDER = Path(__file__).resolve().parent
COMMITTED = FOLDER / "inputs"  # the ci profile, committed
GENERATED = FOLDER / ".work" / "inputs"  # other profiles, generated when needed (git-ignored)

WORKLOADS = ("text", "img1", "img8", "img30", "business")
FIXED_IMAGES = {"text": 0, "img1": 1, "img8": 8, "img30": 30}

# The business mix's images per request: (fewest, most, share of requests), uniform inside a bucket.
IMAGE_BUCKETS = ((1, 1, 0.25), (2, 4, 0.30), (5, 10, 0.25), (11, 20, 0.12), (21, 30, 0.08))

QUESTIONS = (
    "Here are {n} pictures from one case. What does each show, and how do they differ?",
    "Read every number you can find in these {n} images and say which image it is in.",
    "Which of these {n} images shows a price tag, and what does the tag say?",
    "Summarise what these {n} images have in common, then describe the odd one out.",
    "The {n} images are pages of one document. Explain what the document is about.",
)
STORIES = (
    "Tell me a long story about a lighthouse keeper and the ships she saw.",
    "Explain, step by step, how a harbour crane unloads a container ship.",
    "Describe a day in a busy market, from the first stall opening to the last one closing.",
)


@dataclass(frozen=True)
class Profile:
    image_size: tuple[int, int]  # (width, height) of every JPEG
    quality: int  # JPEG quality
    tokens: int  # max_tokens of the fixed workloads
    answer_tokens: tuple[int, int]  # the business mix's answer lengths, inclusive
    entries: int  # requests per fixed-workload file (distinct prompts and images)
    business_entries: int


PROFILES = {
    # CPU/CI: keeps the mix's image counts, shortens answers so a tiny-model run takes seconds.
    "ci": Profile(image_size=(64, 64), quality=75, tokens=16, answer_tokens=(8, 32), entries=2, business_entries=8),
    # H200: the seed's answer lengths, images of a typical phone photo / scanned page once resized.
    "full": Profile(image_size=(512, 512), quality=75, tokens=128, answer_tokens=(64, 256), entries=8,
                    business_entries=250),
}


def bytes_tensor(items: list[bytes]) -> dict:
    """A BYTES tensor in perf_analyzer's b64 form. perf_analyzer sends the decoded bytes as the
    tensor's raw contents, so they must be Triton's serialisation: each element a 4-byte
    little-endian length, then its bytes (tritonclient's serialize_byte_tensor)."""
    from tritonclient.utils import serialize_byte_tensor

    raw = serialize_byte_tensor(np.array(items, dtype=np.object_)).item()
    return {"b64": base64.b64encode(raw).decode("ascii"), "shape": [len(items)]}


def request(text: str, images: list[bytes], max_tokens: int) -> dict:
    """One perf_analyzer data entry: a streamed answer of exactly max_tokens tokens."""
    entry = {"text_input": [text], "stream": [True], "max_tokens": [int(max_tokens)], "ignore_eos": [True]}
    if images:  # optional input: a text-only request leaves it out
        entry["images"] = bytes_tensor(images)
    return entry


def business_shape(rng: np.random.Generator, answer_tokens: tuple[int, int]) -> tuple[int, int]:
    """(images, answer tokens) of one business-mix request."""
    low, high, _ = IMAGE_BUCKETS[rng.choice(len(IMAGE_BUCKETS), p=[b[2] for b in IMAGE_BUCKETS])]
    return int(rng.integers(low, high + 1)), int(rng.integers(answer_tokens[0], answer_tokens[1] + 1))


def shapes(workload: str, profile: Profile, entries: int, seed: int) -> list[tuple[int, int]]:
    """(images, max_tokens) of each entry of a workload."""
    if workload in FIXED_IMAGES:
        return [(FIXED_IMAGES[workload], profile.tokens)] * entries
    rng = np.random.default_rng([seed, WORKLOADS.index(workload)])
    return [business_shape(rng, profile.answer_tokens) for _ in range(entries)]


def _jpeg(args: tuple[int, tuple[int, int], int]) -> bytes:
    from zipmoe.clients.bench_common import synthetic_jpeg

    return synthetic_jpeg(*args)


def build(workload: str, profile: Profile, entries: int | None = None, seed: int = 0, workers: int = 1) -> dict:
    """The {"data": [...]} document of a workload; images drawn in `workers` processes."""
    plan = shapes(workload, profile, entries or (profile.business_entries if workload == "business"
                                                  else profile.entries), seed)
    offset = (seed * len(WORKLOADS) + WORKLOADS.index(workload)) * 10**6  # distinct images per workload and seed
    jobs = [(offset + i * 100 + k, profile.image_size, profile.quality) for i, (n, _) in enumerate(plan)
            for k in range(n)]
    if workers > 1 and len(jobs) > 32:
        with ProcessPoolExecutor(workers) as pool:
            jpegs = iter(list(pool.map(_jpeg, jobs, chunksize=8)))
    else:
        jpegs = iter(map(_jpeg, jobs))
    data = []
    for i, (n, max_tokens) in enumerate(plan):
        text = (QUESTIONS[i % len(QUESTIONS)].format(n=n) if n else STORIES[i % len(STORIES)]) + f" (request {i})"
        data.append(request(text, [next(jpegs) for _ in range(n)], max_tokens))
    return {"data": data}


def write(document: dict, path: Path) -> Path:
    """One entry per line: readable diffs of the committed files, and a stable byte-for-byte output."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = ",\n".join(json.dumps(e, separators=(",", ":")) for e in document["data"])
    path.write_text('{"data": [\n' + lines + "\n]}\n")
    return path


def input_file(workload: str, profile: str) -> Path:
    """Where a workload's file of a profile lives (ci: committed; others: generated)."""
    return (COMMITTED if profile == "ci" else GENERATED / profile) / f"{workload}.json"


def ensure_input(workload: str, profile: str, workers: int = 1) -> Path:
    """The workload's file for a profile, generated (default entries, seed 0) when missing."""
    path = input_file(workload, profile)
    if not path.exists():
        print(f"generating {path} ...", flush=True)
        write(build(workload, PROFILES[profile], workers=workers), path)
    return path


def main(argv: list[str] | None = None) -> int:
    import os

    p = argparse.ArgumentParser(prog="python -m perf_analyzer_configs.make_inputs", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--profile", choices=sorted(PROFILES), default="ci")
    p.add_argument("--workload", action="append", choices=WORKLOADS, help="repeatable (default: all)")
    p.add_argument("--entries", type=int, help="requests per file (default: the profile's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", type=Path, help="default: inputs/ for ci, .work/inputs/PROFILE/ otherwise")
    args = p.parse_args(argv)
    for workload in args.workload or WORKLOADS:
        path = (args.out_dir / f"{workload}.json") if args.out_dir else input_file(workload, args.profile)
        write(build(workload, PROFILES[args.profile], args.entries, args.seed, workers=os.cpu_count() or 1), path)
        print(f"wrote {path} ({path.stat().st_size / 1e6:.1f} MB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
