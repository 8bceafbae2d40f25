"""The perf_analyzer runs' presentation: a text table, the rate to use, the comparison with topk, the PNG.

    python -m perf_analyzer_configs.report PREFIX.json [--out PREFIX]

Input: the JSON `python -m perf_analyzer_configs.run --out PREFIX` writes. Besides the table it prints,
per workload x model x routing with concurrency rows, the most requests/s reached and 65 % of it (the
seed measures at one rate of about 60-70 % of topk's maximum throughput), and for every rate run
measured with topk as well, each other routing's TPOT and TTFT p50 against topk's (a routing label
with a variant, "sere sync", against "topk sync"; see `baseline`). The PNG: the
latency-throughput curve (TPOT p50 and TTFT p50 against output tokens/s, one point per concurrency)
and the rate runs' TPOT and TTFT (p50 and p99).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from zipmoe.clients.bench_serving_report import fmt, prefix
from zipmoe.plotting import pyplot, write_plot

RATE_SHARE = 0.65  # of topk's maximum throughput: where the seed's 1,000-request run sits


def label(r: dict) -> str:
    return f"{r['workload']} {r['model']} {r['routing']}"


def suggested_rates(rows: list[dict]) -> dict[str, tuple[float, int, float]]:
    """label -> (most req/s over its concurrency rows, at which concurrency, RATE_SHARE of it)."""
    best: dict[str, tuple[float, int, float]] = {}
    for r in rows:
        if r["mode"] == "concurrency" and r.get("req_s") and r["req_s"] > best.get(label(r), (0,))[0]:
            best[label(r)] = (r["req_s"], r["value"], round(RATE_SHARE * r["req_s"], 2))
    return best


def baseline(routing: str) -> str:
    """The topk run a routing's rate row is read against: a variant label ("sere sync", the
    routing plus the setting that differs) against topk with the same variant ("topk sync"); a
    topk variant against plain topk."""
    policy, _, variant = routing.partition(" ")
    return "topk" if policy == "topk" or not variant else f"topk {variant}"


def against_topk(rows: list[dict]) -> list[str]:
    """Each non-topk rate row's TPOT and TTFT p50 as a change from its baseline topk's at the same rate."""
    base = {(r["workload"], r["model"], r["value"], r["routing"]): r for r in rows if r["mode"] == "rate"}
    lines = []
    for r in rows:
        ref = baseline(r["routing"])
        b = base.get((r["workload"], r["model"], r["value"], ref))
        if r["mode"] != "rate" or r["routing"] == "topk" or b is None:
            continue
        change = {k: (r[k] / b[k] - 1) * 100 if r.get(k) and b.get(k) else None for k in ("tpot_ms_p50", "ttft_ms_p50")}
        lines.append(f"{label(r)} at {r['value']:g} req/s vs {ref}: TPOT p50 {fmt(change['tpot_ms_p50'], '+.1f')} %, "
                     f"TTFT p50 {fmt(change['ttft_ms_p50'], '+.1f')} %, errors {r['errors']} ({ref} {b['errors']})")
    return lines


def table(result: dict) -> str:
    lines = [f"{result['device']}, {result['checkpoint']}, perf_analyzer {result.get('perf_analyzer')}, "
             f"inputs {result.get('inputs')}, {result.get('distribution')} arrivals"
             + "".join(f"\n  {routing}: " + ", ".join(f"{m}.{k}={v}" for m, p in overrides.items() for k, v in p.items())
                       for routing, overrides in result.get("overrides", {}).items()),
             f"{'workload':<10} {'model':<9} {'routing':<10} {'mode':<11} {'value':>6} {'n':>5} {'err':>4} "
             f"{'TTFT p50/p99 ms':>17} {'TPOT p50/p99 ms':>16} {'ITL p99':>8} {'out tok/s':>9} {'req/s':>6} {'experts':>7}"]
    for r in result["rows"]:
        lines.append(f"{r['workload']:<10} {r['model']:<9} {r['routing']:<10} {r['mode']:<11} {r['value']:>6g} "
                     f"{r['n']:>5} {r['errors']:>4} {fmt(r['ttft_ms_p50']):>8}/{fmt(r['ttft_ms_p99']):<8} "
                     f"{fmt(r['tpot_ms_p50'], '.2f'):>7}/{fmt(r['tpot_ms_p99'], '.2f'):<8} "
                     f"{fmt(r['itl_ms_p99'], '.1f'):>8} {fmt(r['out_tok_s']):>9} {fmt(r.get('req_s'), '.2f'):>6} "
                     f"{fmt(r.get('experts_read'), '.2f'):>7}")
        if r.get("note"):
            lines.append(f"    note: {r['note']}")
    for name, (req_s, concurrency, rate) in suggested_rates(result["rows"]).items():
        lines.append(f"{name}: at most {req_s:.2f} req/s (concurrency {concurrency}); "
                     f"{RATE_SHARE:.0%} of it: --rate {rate:g}")
    return "\n".join(lines + against_topk(result["rows"]))


def plot(result: dict, path: Path) -> bool:
    """False without matplotlib."""
    plt = pyplot()
    if plt is None:
        return False

    fig, axes = plt.subplots(2, 2, figsize=(13, 9))
    curves: dict[str, list[dict]] = {}
    for r in result["rows"]:
        if r["mode"] == "concurrency" and r["n"]:
            curves.setdefault(label(r), []).append(r)
    for ax, key, title in ((axes[0][0], "tpot_ms_p50", "TPOT p50"), (axes[0][1], "ttft_ms_p50", "TTFT p50")):
        for name, rows in curves.items():
            rows = sorted(rows, key=lambda r: r["value"])
            ax.plot([r["out_tok_s"] for r in rows], [r[key] for r in rows], marker="o", label=name)
            for r in rows:
                ax.annotate(f"c={r['value']:g}", (r["out_tok_s"], r[key]), fontsize=7, xytext=(3, 3),
                            textcoords="offset points")
        ax.set(xlabel="output tokens/s", ylabel="ms")
        ax.set_title(f"{title} vs throughput, fixed concurrency", fontsize=10)
    rated = [r for r in result["rows"] if r["mode"] == "rate" and r["n"]]
    # the workload and model go into a tick only when the rate runs differ in them (else they crowd it)
    mixed = len({(r["workload"], r["model"]) for r in rated}) > 1
    names = [f"{r['routing']}\n" + (f"{r['workload']} {r['model']}\n" if mixed else "") + f"{r['value']:g} req/s"
             for r in rated]
    for ax, metric, title in ((axes[1][0], "tpot", "TPOT"), (axes[1][1], "ttft", "TTFT")):
        for shift, q in ((-0.2, 50), (0.2, 99)):
            ax.bar([i + shift for i in range(len(rated))], [r[f"{metric}_ms_p{q}"] or 0 for r in rated], width=0.4,
                   label=f"p{q}")
        ax.set_xticks(range(len(rated)), names, fontsize=7)
        ax.set(ylabel="ms")
        scope = "" if mixed or not rated else f", {rated[0]['workload']} into {rated[0]['model']}"
        ax.set_title(f"{title} at a fixed request rate ({result.get('distribution')} arrivals{scope})", fontsize=10)
    for ax, shown in ((axes[0][0], curves), (axes[0][1], curves), (axes[1][0], rated), (axes[1][1], rated)):
        if shown:
            ax.legend(fontsize=7)
        else:
            ax.text(0.5, 0.5, "not run", ha="center", va="center", transform=ax.transAxes, color="grey")
    fig.suptitle(f"{result['device']}: {result['checkpoint']} (perf_analyzer {result.get('perf_analyzer')})",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def show(result: dict, out: Path | None) -> None:
    """Prints the table; with out (a PREFIX), writes PREFIX.png as well, saying what became of it."""
    print(table(result))
    if out is not None:
        png = out.with_name(out.name + ".png")
        png.parent.mkdir(parents=True, exist_ok=True)
        write_plot(result, png, plot)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m perf_analyzer_configs.report", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("json", type=Path, help="PREFIX.json that perf_analyzer_configs.run wrote")
    p.add_argument("--out", type=Path, help="writes PREFIX.png (default: the JSON's PREFIX)")
    args = p.parse_args(argv)
    show(json.loads(args.json.read_text()), prefix(args.out or args.json))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
