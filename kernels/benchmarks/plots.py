"""The PNG beside bench_kernels' JSON: one panel for each kind of row the run holds.

- moe_layer rows: achieved GB/s of the MoE layer against the copy bandwidth of the same run;
- decode_step rows: TPOT per batch and policy;
- step_variant / step_knob rows (bench_one_token, bench_step_knobs): each variant's graph replay
  against its set's committed choices timed first in the same engine, in percent, one bar per case.
A run with none of them writes no PNG.
"""
from __future__ import annotations

from pathlib import Path

from zipmoe.plotting import pyplot


def _moe_panel(ax, rows: list[dict], copy: float, device: str) -> None:
    impls = sorted({r["impl"] for r in rows})
    for impl, policy in sorted({(r["impl"], r["policy"]) for r in rows}):
        pts = [(r["batch"], r["gbps"]) for r in rows if r["impl"] == impl and r["policy"] == policy]
        ax.plot(*zip(*pts), marker="o", ls="--" if "uniform" in policy else "-", color=f"C{impls.index(impl)}",
                label=impl + (", uniform routing" if "uniform" in policy else ""))
    ax.axhline(copy, color="k", ls="--", label=f"device copy {copy:.0f} GB/s")
    ax.axhline(0.8 * copy, color="gray", ls=":", label="80 % of copy")
    ax.set(xscale="log", xlabel="tokens per MoE layer call", ylabel="achieved GB/s (expert weights)",
           title=f"MoE layer, Qwen3-30B-A3B shape, {device}")
    ax.legend(fontsize=8)


def _decode_panel(ax, rows: list[dict]) -> None:
    # solid: the engine's default, pipelined steps; dashed, same colour: one step at a time
    for i, policy in enumerate(sorted({r["policy"] for r in rows})):
        for impl, style, suffix in (("engine_step_async", "-", ""), ("engine_step", "--", ", one at a time")):
            pts = [(r["batch"], r["time_us"] / 1e3) for r in rows if r["impl"] == impl and r["policy"] == policy]
            if pts:
                ax.plot(*zip(*pts), marker="o", ls=style, color=f"C{i}", label=policy + suffix)
    ax.set(xscale="log", xlabel="decode batch", ylabel="TPOT (ms)", title="decode step, 48 layers, CUDA graphs")
    ax.legend(fontsize=8)


def variant_changes(rows: list[dict]) -> tuple[list, list, dict]:
    """(cases, variants, {(variant, case): percent}): each variant's graph replay against the first
    row of its own set and case, a set's committed choices (a step_knob's set is the policy's text
    before ": "; step_variant rows are one set)."""
    rows = [r for r in rows if r["impl"] == "graph_replay"]
    cases = list(dict.fromkeys((r["batch"], r.get("context")) for r in rows))
    variants = list(dict.fromkeys(r["policy"] for r in rows))
    first, change = {}, {}
    for r in rows:
        case = (r["batch"], r.get("context"))
        reference = first.setdefault((r["policy"].partition(": ")[0] if ": " in r["policy"] else "", case),
                                     r["time_us"])
        change[(r["policy"], case)] = 100 * (r["time_us"] / reference - 1)
    return cases, variants, change


def _variants_panel(ax, rows: list[dict]) -> None:
    cases, variants, change = variant_changes(rows)
    width = 0.8 / len(cases)
    for j, case in enumerate(cases):
        ax.barh([i + j * width for i in range(len(variants))], [change.get((v, case), 0.0) for v in variants],
                height=width, label=f"batch {case[0]}" + (f", {case[1]}-token prompt" if case[1] else ""))
    ax.set_yticks([i + 0.4 - width / 2 for i in range(len(variants))], variants, fontsize=7)
    ax.set_ylim(len(variants), -0.5)
    ax.axvline(0, color="k", lw=0.8)
    ax.set(xlabel="graph replay against its set's committed choices, timed first (%)",
           title="the decode step under each variant (lower is faster)")
    ax.legend(fontsize=7, loc="lower right")


def plot(result: dict, out: Path) -> bool:
    """Writes out (PNG) with a panel for each kind of row in result["rows"]; False, and nothing
    written, if there are none or matplotlib is missing."""
    def of(*benches: str) -> list[dict]:
        return [r for r in result["rows"] if r["bench"] in benches]

    panels = [(draw, chosen) for draw, chosen in (
        (lambda ax, rs: _moe_panel(ax, rs, result["copy_gbps"], result["device"]), of("moe_layer")),
        (_decode_panel, of("decode_step")),
        (_variants_panel, of("step_variant", "step_knob")),
    ) if chosen]
    if not panels:
        return False
    plt = pyplot()
    if plt is None:
        return False

    # A knob run holds up to ~50 variants, a bar row each: the figure grows with them so their labels stay legible.
    rows_drawn = max((len(variant_changes(chosen)[1]) for draw, chosen in panels if draw is _variants_panel), default=0)
    fig, axes = plt.subplots(1, len(panels), figsize=(7 * len(panels) + (4 if rows_drawn else 0),
                                                      max(5.5, 0.22 * rows_drawn)), squeeze=False)
    for ax, (draw, chosen) in zip(axes[0], panels):
        draw(ax, chosen)
    fig.tight_layout()
    fig.savefig(out, dpi=120, bbox_inches="tight")  # long variant names: nothing cut at the edge
    plt.close(fig)
    return True
