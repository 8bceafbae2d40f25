"""How a request's notes would share the VisionZip budget, offline (no server): for each vision
layer as `importance_layer` and each `budget_weighting`, the mean visual tokens a detail-dense and
a plain note keep, plus how peaked each kind's importance is and how many distinct tokens it has.
For choosing those two vision_encoder parameters for a checkpoint before serving it.

    python -m zipmoe.clients.budget_report [--checkpoint checkpoints/notes] [--n 150] [--keep 0.6 0.5]
                                           [--out docs/results/budget_notes.json]
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

from zipmoe import serve
from zipmoe.build import notes_data
from zipmoe.clients.checkpoint_paths import display_path
from zipmoe.visionzip import BUDGET_WEIGHTINGS, ImageFeatures, compress, distinct_token_count, weigh_images

KINDS = ("dense", "plain")


def _mean(values: list[float]) -> float | None:
    return float(np.mean(values)) if values else None


def perplexity(importance: torch.Tensor) -> float:
    """exp(entropy) of one image's importance as a distribution: N for uniform attention, 1 for one token."""
    p = importance.double() / importance.double().sum()
    return float(torch.exp(-(p * p.clamp_min(1e-30).log()).sum()))


def reweighed(features: list[ImageFeatures], weighting: str) -> list[ImageFeatures]:
    """The same features with the importance a vision_encoder configured with `weighting` sends."""
    weighed = weigh_images(torch.cat([f.importance for f in features]), [f.embeds for f in features], weighting)
    return [ImageFeatures(f.embeds, f.deepstack, imp, f.keys, f.grid)
            for f, imp in zip(features, weighed.split([f.embeds.shape[0] for f in features]))]


def per_kind(requests: list[tuple[tuple[str, ...], list[ImageFeatures]]], stat) -> dict[str, float | None]:
    """The mean of stat(features) over the images of each kind."""
    values = {k: [] for k in KINDS}
    for kinds, features in requests:
        for kind, f in zip(kinds, features):
            values[kind].append(float(stat(f)))
    return {k: _mean(v) for k, v in values.items()}


def layer_report(requests: list[tuple[tuple[str, ...], list[ImageFeatures]]], keeps: list[float]) -> dict:
    """requests: (kinds, features with size-weighted importance) -> each kind's importance perplexity
    and the tokens it keeps under each weighting."""
    kept = {w: {keep: {k: [] for k in KINDS} for keep in keeps} for w in BUDGET_WEIGHTINGS}
    for kinds, features in requests:
        for weighting in BUDGET_WEIGHTINGS:
            weighed = reweighed(features, weighting)
            for keep in keeps:
                for kind, tokens in zip(kinds, compress(weighed, keep)):
                    kept[weighting][keep][kind].append(tokens.embeds.shape[0])
    return {"perplexity": per_kind(requests, lambda f: perplexity(f.importance)),
            "tokens_kept": {w: {repr(keep): {k: _mean(v) for k, v in by_kind.items()}
                                for keep, by_kind in by_keep.items()}
                            for w, by_keep in kept.items()}}


def report(checkpoint: str | Path, n: int = 150, keeps: tuple[float, ...] = (0.6, 0.5), split: str = "test") -> dict:
    from zipmoe.vision import VisionEncoder, pixels_of

    examples = notes_data.examples(split, n)
    depth = json.loads((Path(checkpoint) / "config.json").read_text())["vision_config"]["depth"]
    layers = {}
    for layer in range(depth):
        encoder = VisionEncoder(checkpoint, torch.device("cpu"), torch.float32, layer, budget_weighting="size")
        requests = [(ex.kinds, encoder.features([pixels_of(im) for im in ex.images])) for ex in examples]
        layers[str(layer)] = layer_report(requests, list(keeps))
    # The merged embeddings do not depend on the importance layer: their distinct tokens once.
    distinct = per_kind(requests, lambda f: distinct_token_count(f.embeds))
    return {"checkpoint": display_path(Path(checkpoint)), "split": split, "n": n, "distinct_tokens": distinct,
            "layers": layers}


def table(result: dict) -> str:
    dist = result["distinct_tokens"]
    lines = [f"{result['checkpoint']}, {result['n']} {result['split']} examples: distinct tokens per image, dense / "
             f"plain: {dist['dense']:.1f} / {dist['plain']:.1f}; tokens kept per image, dense / plain (dense share)",
             f"{'layer':>5} {'perplexity d/p':>15}  " + "  ".join(
                 f"{w + ' @' + keep:>22}" for w in BUDGET_WEIGHTINGS
                 for keep in next(iter(result["layers"].values()))["tokens_kept"][w])]
    for layer, r in result["layers"].items():
        cells = []
        for w in BUDGET_WEIGHTINGS:
            for keep, kinds in r["tokens_kept"][w].items():
                d, p = kinds["dense"], kinds["plain"]
                cells.append(f"{d:5.1f} / {p:4.1f} ({d / p:4.2f}x)" if d and p else "-")
        ppl = r["perplexity"]
        lines.append(f"{layer:>5} {ppl['dense']:6.1f} / {ppl['plain']:5.1f}  " + "  ".join(f"{c:>22}" for c in cells))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m zipmoe.clients.budget_report", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", type=Path, default=serve.TRAINED_CHECKPOINT)
    p.add_argument("--n", type=int, default=150, help="notes_data examples (default: 150)")
    p.add_argument("--split", default="test")
    p.add_argument("--keep", type=float, nargs="+", default=[0.6, 0.5], help="keep ratios (default: 0.6 0.5)")
    p.add_argument("--out", type=Path, default=None, help="also write the result as JSON")
    args = p.parse_args(argv)
    result = report(args.checkpoint, args.n, tuple(args.keep), args.split)
    print(table(result))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
