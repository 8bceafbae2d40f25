"""The serving benchmark's presentation: the text table and the PNG of one result.

    python -m zipmoe.clients.bench_serving_report PREFIX.json [--out PREFIX]

Input: the JSON `python -m zipmoe.clients.bench_serving --out PREFIX` writes, {device, copy_gbps,
checkpoint, overrides, extra_args, rows} (keys the table and plot do not use are ignored).
bench_serving prints the same table and writes the same PNG through this module when a run ends;
run this to render them again from a saved JSON, e.g. when the bench ran where matplotlib (the
`bench` extra) was missing. Prints the table and writes PREFIX.png (default: next to the JSON).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from zipmoe.clients.trace_timeline import longest
from zipmoe.plotting import pyplot, write_plot

TAIL = 90  # the ITL plot shows percentiles TAIL..100
PARTS = ("preprocess", "image_decode", "vision_forward", "visionzip", "vision_encoder", "decoder_ttft", "postprocess")


def prefix(path: Path) -> Path:
    """PREFIX of a path given as PREFIX, PREFIX.json or PREFIX.png."""
    return path.with_suffix("") if path.suffix in (".json", ".png") else path


def fmt(v, spec=".1f") -> str:
    return "-" if v is None else format(v, spec)


def table(result: dict) -> str:
    lines = [f"{result['device']}, copy {fmt(result['copy_gbps'], '.0f')} GB/s, {result['checkpoint']}"
             + "".join(f", {m}.{k}={v}" for m, p in result["overrides"].items() for k, v in p.items()),
             f"{'bench':<12} {'size':>9} {'keep':>4} {'conc':>4} {'imgs':>4} {'n':>4} {'TTFT p50/p90 ms':>17} "
             f"{'TPOT p50/p90 ms':>16} {'ITL p99':>8} {'tok/s':>8} {'img/s':>8}"]
    for r in result["rows"]:
        lines.append(f"{r['bench']:<12} {r.get('image_size', ''):>9} {fmt(r['keep_ratio'], '.2f'):>4} "
                     f"{r['concurrency']:>4} {r['images']:>4} {r['n']:>4} {fmt(r['ttft_ms_p50']):>8}/"
                     f"{fmt(r['ttft_ms_p90']):<8} {fmt(r['tpot_ms_p50'], '.2f'):>7}/{fmt(r['tpot_ms_p90'], '.2f'):<8} "
                     f"{fmt(r['itl_ms_p99'], '.2f'):>8} {fmt(r['tokens_per_s']):>8} {fmt(r['images_per_s']):>8}")
        extra = {k: r[k] for k in ("breakdown_ms", "phases_ms", "client_images_per_s", "resized", "server_tpot_ms", "itl_ms_p50",
                                   "experts_read", "failed", "first_error", "note") if r.get(k) is not None}
        if extra:
            lines.append("    " + "; ".join(f"{k}: " + (", ".join(f"{p} {fmt(v, '.2f')}" for p, v in x.items())
                                                        if isinstance(x, dict) else str(x)) for k, x in extra.items()))
        if r.get("timeline_ms"):  # Triton's trace: the longest spans of a request, then the whole
            spans = ", ".join(f"{k} {fmt(v, '.2f')}" for k, v in longest(r["timeline_ms"], 8))
            lines.append(f"    timeline_ms (longest): {spans}; total {fmt(r['timeline_ms'].get('total'), '.2f')}")
        if r.get("long_gaps"):  # clients/bench_mixed.py
            g = r["long_gaps"]
            starts = ", ".join(f"{k} ms: {n}" for k, n in g["start_after_send_ms"].items())
            lines.append(f"    long gaps (> {fmt(g['threshold_ms'], '.1f')} ms): {g['per_request_and_stream']} per image "
                         f"request and stream, {g['at_first_token_per_request_and_stream']} ending at its first "
                         f"token; start after the send: {starts}")
    return "\n".join(lines)


def plot(result: dict, path: Path) -> bool:
    """Left: TTFT p50 per image size and keep ratio, the server's parts (means) stacked, "other" the rest
    of the p50. Right: the mixed bench's ITL distribution. False without matplotlib."""
    plt = pyplot()
    if plt is None:
        return False

    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5))
    ttft = [r for r in result["rows"] if r["bench"] == "ttft_30img" and r["ttft_ms_p50"] is not None]
    colours = dict(zip(PARTS, plt.get_cmap("tab10").colors))
    for i, r in enumerate(ttft):
        parts = {k: v for k, v in (r.get("breakdown_ms") or {}).items() if v is not None}
        if "vision_encoder" in parts:  # what vision_encoder spends beyond its two measured parts
            parts["vision_encoder"] = max(0.0, parts["vision_encoder"] - parts.get("vision_forward", 0)
                                          - parts.get("visionzip", 0))
        bottom = 0.0
        for part in (p for p in PARTS if p in parts):
            rest = part == "vision_encoder" and "vision_forward" in parts
            left.bar(i, parts[part], bottom=bottom, color=colours[part], label=None if i else part + " (rest)" * rest)
            bottom += parts[part]
        left.bar(i, max(0.0, r["ttft_ms_p50"] - bottom), bottom=bottom, color="lightgrey",
                 label=None if i else "other (IPC, gRPC)")
    config = lambda r: "\n" + r["config"].replace(", ", "\n") if r.get("config") else ""  # noqa: E731
    left.set_xticks(range(len(ttft)), [f"{r['image_size']}\nkeep {r['keep_ratio']:g}{config(r)}" for r in ttft], fontsize=7)
    left.set(ylabel="ms")
    left.set_title(f"TTFT p50, {ttft[0]['images'] if ttft else 0} images, server parts stacked", fontsize=10)
    mixed = [r for r in result["rows"] if r["bench"] in ("mixed", "mixed_text") and r.get("itl_ms_quantiles")]
    for r in mixed:
        arrivals = "text prompts as long" if r["bench"] == "mixed_text" else f"{r['images']} images"
        config = f" ({r['config']})" if r.get("config") else ""  # a row's label in a comparison of set-ups
        right.plot(r["itl_ms_quantiles"][TAIL:], range(TAIL, 101), marker=".",
                   label=f"{r['concurrency']} streams + {arrivals}{config}")
        right.set_xscale("log")
    right.set(xlabel="inter-token gap, ms", ylabel="percentile")
    right.set_title(f"mixed: ITL of the text streams, percentiles {TAIL}-100 (the target reads p99 / p50)", fontsize=10)
    for ax, rows in ((left, ttft), (right, mixed)):
        if rows:
            ax.legend(fontsize=7)
        else:
            ax.text(0.5, 0.5, "not run", ha="center", va="center", transform=ax.transAxes, color="grey")
    fig.suptitle(f"{result['device']}: {result['checkpoint']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m zipmoe.clients.bench_serving_report", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("json", type=Path, help="PREFIX.json that bench_serving wrote")
    p.add_argument("--out", type=Path, help="writes PREFIX.png (default: the JSON's PREFIX)")
    args = p.parse_args(argv)
    result = json.loads(args.json.read_text())
    print(table(result))
    out = prefix(args.out or args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_plot(result, out.with_name(out.name + ".png"), plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
