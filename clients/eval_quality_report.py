"""`zipmoe eval`'s report of a result (`clients/eval_quality.py` makes it): the table it prints and
the bar charts it saves, each row labelled by its routing and budget weighting.
"""
from __future__ import annotations

from pathlib import Path

from zipmoe.plotting import pyplot

DEFAULT_BUDGET = "distinct"  # vision_encoder's budget_weighting in model_repository


def row_label(row: dict) -> str:
    if row["routing"] == "sere":
        label = f"sere K'={row['primary_k']} ρ={row['rho']:g} {'+P' if row['protect'] else '-P'}"
    elif row["routing"] == "oea":
        label = f"oea k0={row['primary_k']}"
    else:
        label = row["routing"]
    return label if row.get("budget", DEFAULT_BUDGET) == DEFAULT_BUDGET else f"{label}, budget by {row['budget']}"


def experts_saved(row: dict) -> float | None:
    """Per cent of the router's expert union that the policy did not compute, in the row's own decode
    steps: a like-for-like saving, where a topk row run apart held other batches (docs/QUALITY.md)."""
    routed, read = row.get("experts_routed"), row.get("experts_read")
    return None if not routed or read is None else 100.0 * (1.0 - read / routed)


def table(result: dict) -> str:
    def fmt(v, spec=""):
        return "-" if v is None else format(v, spec)

    head = ("keep", "routing", "K'", "rho", "protect", "budget", "accuracy", "failed", "seconds", "routed", "read",
            "saved", "moved", "beside")
    overrides = ", ".join(f"{m}.{k}={v}" for m, params in result.get("overrides", {}).items()
                          for k, v in params.items())
    lines = [f"{result['checkpoint']}, split {result['split']}, n={result['n']}"
             + (f", with {overrides}" if overrides else "")
             + "  (routed/read: distinct experts per MoE layer-step; saved: 1 - read/routed, %; moved: slots"
             " re-routed per generated token; beside: share of those tokens decoded in a step with a prompt chunk)",
             "{:>5} {:<8} {:>3} {:>4} {:>7} {:>8} {:>8} {:>6} {:>8} {:>6} {:>6} {:>5} {:>6} {:>6}  by task"
             .format(*head)]
    for r in result["rows"]:
        tasks = " ".join(f"{t}={v:.2f}" for t, v in r["by_task"].items())
        protect = None if r["protect"] is None else ("on" if r["protect"] else "off")
        lines.append(f"{r['keep_ratio']:>5.2f} {r['routing']:<8} {fmt(r['primary_k']):>3} {fmt(r['rho'], 'g'):>4} "
                     f"{fmt(protect):>7} {r['budget']:>8} {r['accuracy']:>8.3f} {r['failed']:>6} {r['seconds']:>8.1f} "
                     f"{fmt(r['experts_routed'], '.2f'):>6} {fmt(r['experts_read'], '.2f'):>6} "
                     f"{fmt(experts_saved(r), '.1f'):>5} {fmt(r['moved_per_token'], '.2f'):>6} "
                     f"{fmt(r.get('beside_prompts'), '.2f'):>6}  {tasks}")
    budgets = {DEFAULT_BUDGET: result["tokens_kept_by_keep"], **result["tokens_kept_by_budget"]}
    for budget, by_keep in budgets.items():
        lines.append(f"visual tokens kept per image (mean), budget by {budget}: " + "; ".join(
            f"keep {k}: " + ", ".join(f"{kind} {fmt(v, '.1f')}" for kind, v in kinds.items())
            for k, kinds in by_keep.items()))
    for r in result["rows"]:
        if r["failed"]:
            lines.append(f"keep {r['keep_ratio']} {row_label(r)}: {r['failed']} requests failed, first: "
                         f"{r['first_error']}")
    return "\n".join(lines)


def plot(result: dict, path: Path, metric: str = "accuracy") -> bool:
    """Bar charts of the rows' `metric` (accuracy, or v2's f1): (a) keep ratios at topk, one bar per
    budget weighting, (b) routings at keep 1.0. False without matplotlib."""
    plt = pyplot()
    if plt is None:
        return False

    topk = [r for r in result["rows"] if r["routing"] == "topk"]
    keeps = sorted({r["keep_ratio"] for r in topk}, reverse=True)
    budgets = [DEFAULT_BUDGET] + sorted({r["budget"] for r in topk} - {DEFAULT_BUDGET})
    routing_rows = [r for r in result["rows"] if r["keep_ratio"] == 1.0]
    fig, axes = plt.subplots(1, 2, figsize=(4 + 0.55 * (len(keeps) * len(budgets) + len(routing_rows)), 4.8),
                             squeeze=False, gridspec_kw={"width_ratios": [max(1, len(keeps) * len(budgets)),
                                                                          max(1, len(routing_rows))]})
    ax = axes[0][0]
    width = 0.8 / len(budgets)
    for j, budget in enumerate(budgets):
        acc = {r["keep_ratio"]: r[metric] for r in topk if r["budget"] == budget}
        xs = [i for i, k in enumerate(keeps) if k in acc]
        bars = ax.bar([x + (j - (len(budgets) - 1) / 2) * width for x in xs], [acc[keeps[x]] for x in xs], width,
                      label=f"budget by {budget}")
        ax.bar_label(bars, fmt="%.2f", fontsize=7)
    ax.set_xticks(range(len(keeps)), [f"{k:.1f}" for k in keeps], fontsize=8)
    ax.set_xlabel("keep ratio")
    ax.set_title("(a) VisionZip keep ratio, routing topk", fontsize=10)
    if len(budgets) > 1:
        ax.legend(fontsize=7, loc="lower left")
    ax = axes[0][1]
    bars = ax.bar(range(len(routing_rows)), [r[metric] for r in routing_rows],
                  color=["tab:blue" if r["routing"] == "topk" else "tab:orange" for r in routing_rows])
    ax.bar_label(bars, fmt="%.2f", fontsize=7)
    ax.set_xticks(range(len(routing_rows)), [row_label(r) for r in routing_rows], rotation=45, ha="right", fontsize=8)
    ax.set_xlabel("routing")
    ax.set_title("(b) decode routing, keep 1.0", fontsize=10)
    for ax, rows in ((axes[0][0], topk), (axes[0][1], routing_rows)):
        ax.set_ylim(0, 1.05)
        ax.grid(axis="y", alpha=0.3)
        if not rows:
            ax.text(0.5, 0.5, "not run", ha="center", va="center", transform=ax.transAxes, color="grey")
    axes[0][0].set_ylabel({"accuracy": "exact-match accuracy", "f1": "token F1"}.get(metric, metric))
    fig.suptitle(f"{result['checkpoint']}: {result['split']} split, n={result['n']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
