"""Exact-match accuracy of mm_qa on a notes_data split, per VisionZip keep ratio and decode routing.

    zipmoe eval [--checkpoint checkpoints/notes] [--split test] [--n 200] [--concurrency 16] [--max-tokens 8]
                [--settings full|quick|keep] [--set MODEL.PARAMETER=VALUE ...] [--out docs/results/quality]
                [--taskset notes|v2]
    python -m zipmoe.clients.eval_quality ...      (the same arguments)

Two sweeps through the real server, greedy decoding:
  (a) keep ratio 1.0, 0.7, 0.6, 0.5, 0.3 with routing topk, the images sharing the budget by
      their distinct tokens (vision_encoder's default); again at 0.7-0.3 sharing it by size;
  (b) at keep 1.0: truncate to the first 1 or 2 experts ("top1", "top2"), sere for K' in {1, 2}
      x rho in {0.0, 0.3, 0.5} x protect on/off, oea (k0 = 2); topk at keep 1.0 is shared with (a).
`quick` runs topk at keep 1.0 and 0.5, top2 and sere K'=2 rho=0.5 protect on (a smoke test);
`keep` runs sweep (a) alone on one server; `core` exactly the rows issue 18's targets read, on three
servers (topk at keep 1.0 and 0.6, top2, sere K'=2 rho 0.5 protect on). `--set` changes any other
config.pbtxt parameter on every server (to see what an edit to the repository would do).
One tritonserver per configuration; all examples of a setting go with --concurrency requests in
flight, so decode batches are real. A request that fails counts as wrong and is reported. Each
row also gives what decode routing did, from the server's counters: distinct experts per MoE
layer-step as routed and as computed, and slots moved per generated token. `--taskset v2` asks
task set v2 instead (clients/eval_taskset_v2.py: exact match and token F1 per row, --max-tokens 48
by default).

Writes OUT.json (after every server, so a long run keeps what it measured), OUT.png when matplotlib
is importable (the `bench` extra), and prints a table.
"""
from __future__ import annotations

import argparse
import functools
import json
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from zipmoe import repository_config, serve
from zipmoe.clients.checkpoint_paths import REPO, display_path, ensure_sere, resolve_checkpoint
from zipmoe.clients.eval_quality_report import DEFAULT_BUDGET, plot, row_label
from zipmoe.clients.server_breakdown import settled
from zipmoe.clients.triton_client import counter_deltas, scrape_metrics
from zipmoe.plotting import write_plot

DEFAULT_OUT = REPO / "docs" / "results" / "quality"
KINDS = ("dense", "plain")
KEEP_RATIOS = (1.0, 0.7, 0.6, 0.5, 0.3)
SERE_PRIMARY_K = (1, 2)
SERE_RHO = (0.0, 0.3, 0.5)
SERE_PROTECT = (True, False)
HEADLINE_KEEP = 0.6  # top-level tokens_kept is reported at this keep ratio when it ran
PLANS = ("full", "quick", "keep", "core")


# ---------------------------------------------------------------------------------------- settings

@dataclass(frozen=True)
class Setting:
    """One server's configuration: moe_decoder's decode routing and how vision_encoder's images
    share the VisionZip budget."""
    name: str  # routing as reported: topk | top1 | top2 | sere | oea
    policy: str  # moe_decoder's routing_policy
    params: tuple[tuple[str, str], ...] = ()  # further moe_decoder parameters
    primary_k: int | None = None
    rho: float | None = None
    protect: bool | None = None
    budget: str = DEFAULT_BUDGET  # vision_encoder's budget_weighting

    @property
    def overrides(self) -> dict[str, dict[str, str]]:
        return {"moe_decoder": {"routing_policy": self.policy, **dict(self.params)},
                "vision_encoder": {"budget_weighting": self.budget}}

    @property
    def fields(self) -> dict:
        """The row fields naming this setting."""
        return {"routing": self.name, "primary_k": self.primary_k, "rho": self.rho, "protect": self.protect,
                "budget": self.budget}

    @property
    def slug(self) -> str:
        """A file-name-safe name: server-<slug>.log."""
        name = (self.name if self.name != "sere" else
                f"sere-k{self.primary_k}-rho{self.rho}-{'protect' if self.protect else 'noprotect'}")
        return name if self.budget == DEFAULT_BUDGET else f"{name}-budget-{self.budget}"


TOPK = Setting("topk", "topk")
TOPK_BY_SIZE = Setting("topk", "topk", budget="size")
TOP1 = Setting("top1", "truncate", (("truncate_k", "1"),), primary_k=1)
TOP2 = Setting("top2", "truncate", (("truncate_k", "2"),), primary_k=2)
OEA = Setting("oea", "oea", (("oea_k0", "2"),), primary_k=2)


def sere(primary_k: int, rho: float, protect: bool) -> Setting:
    return Setting("sere", "sere", (("sere_primary_k", str(primary_k)), ("sere_threshold", str(rho)),
                                    ("sere_protect", "true" if protect else "false")), primary_k, rho, protect)


def plan(settings: str) -> list[tuple[Setting, tuple[float, ...]]]:
    """(setting, keep ratios run on its server) in run order; topk at keep 1.0 serves both sweeps
    (at keep 1.0 nothing is dropped, so the budget weighting does not matter there)."""
    if settings == "quick":
        return [(TOPK, (1.0, 0.5)), (TOP2, (1.0,)), (sere(2, 0.5, True), (1.0,))]
    if settings == "keep":
        return [(TOPK, KEEP_RATIOS)]
    if settings == "core":
        return [(TOPK, (1.0, 0.6)), (TOP2, (1.0,)), (sere(2, 0.5, True), (1.0,))]
    if settings == "full":
        return ([(TOPK, KEEP_RATIOS), (TOPK_BY_SIZE, KEEP_RATIOS[1:]), (TOP1, (1.0,)), (TOP2, (1.0,))]
                + [(sere(k, rho, p), (1.0,)) for k in SERE_PRIMARY_K for rho in SERE_RHO for p in SERE_PROTECT]
                + [(OEA, (1.0,))])
    raise ValueError(f"settings must be one of {PLANS}, got {settings!r}")


def server_overrides(setting: Setting, extra: dict[str, dict[str, str]]) -> dict[str, dict[str, str]]:
    """The setting's parameters plus `extra` (from --set); a parameter the harness sweeps cannot be set."""
    merged = {model: dict(params) for model, params in extra.items()}
    for model, params in setting.overrides.items():
        clash = sorted(set(params) & set(merged.get(model, {})))
        if clash:
            raise ValueError(f"--set {model}.{clash[0]} clashes with what the harness sweeps")
        merged.setdefault(model, {}).update(params)
    return merged


# ------------------------------------------------------------------------------------------ scoring

def normalize(text: str) -> str:
    """Strip, lower case, drop one trailing period (ASCII or ideographic), strip again."""
    text = text.strip().lower()
    if text.endswith((".", "。")):
        text = text[:-1].rstrip()
    return text


def exact_match(prediction: str, answer: str) -> bool:
    return normalize(prediction) == normalize(answer)


@dataclass(frozen=True)
class Item:
    """One example as sent: encoded images, kinds per image, question, reference answer, task."""
    question: str
    answer: str
    task: str
    kinds: tuple[str, ...] = ()
    images: tuple[bytes, ...] = ()


@dataclass
class Answer:
    text: str | None = None  # None: the request failed
    correct: bool = False
    kept: list[int] = field(default_factory=list)  # visual_tokens_kept, one per image
    error: str | None = None


def load_items(split: str, n: int, start: int = 0) -> list[Item]:
    from zipmoe.build import notes_data

    return [Item(ex.question, ex.answer, ex.task, tuple(ex.kinds), tuple(notes_data.png_bytes(im) for im in ex.images))
            for ex in notes_data.examples(split, n, start)]


def ask(url: str, item: Item, keep_ratio: float, max_tokens: int, model: str = "mm_qa",
        timeout: float = 600) -> Answer:
    """One greedy, non-streamed request; any failure comes back as Answer.error, never raised."""
    from zipmoe.clients.triton_client import grpc_generate

    # priority 0: measured at exactly keep_ratio, however loaded the server is by the run itself
    inputs = dict(text_input=item.question, visual_keep_ratio=keep_ratio, priority=0, max_tokens=max_tokens,
                  temperature=0.0, stream=False)
    if item.images:
        inputs["images"] = list(item.images)
    text, kept = "", []
    try:
        for r in grpc_generate(url, model=model, timeout=timeout, **inputs):
            text += r.get("text_output") or ""
            kept = r.get("visual_tokens_kept") or kept
    except Exception as e:  # noqa: BLE001 -- a failed request is a wrong answer, reported with its error
        return Answer(error=f"{type(e).__name__}: {e}".strip())
    return Answer(text, exact_match(text, item.answer), list(kept))


def run_setting(url: str, items: list[Item], keep_ratio: float, concurrency: int = 16, max_tokens: int = 8,
                model: str = "mm_qa") -> tuple[list[Answer], float]:
    """Every item at one keep ratio on a running server, `concurrency` requests in flight.
    Returns the answers in item order and the wall time in seconds."""
    start = time.perf_counter()
    with ThreadPoolExecutor(max(1, concurrency)) as pool:
        answers = list(pool.map(lambda item: ask(url, item, keep_ratio, max_tokens, model), items))
    return answers, time.perf_counter() - start


def accuracy(items: list[Item], answers: list[Answer]) -> tuple[float, dict[str, float]]:
    """Overall and per-task exact-match accuracy (failed requests are wrong)."""
    if not items:
        return 0.0, {}
    by_task: dict[str, list[int]] = {}
    for item, a in zip(items, answers, strict=True):
        counts = by_task.setdefault(item.task, [0, 0])
        counts[0] += a.correct
        counts[1] += 1
    overall = sum(a.correct for a in answers) / len(items)
    return overall, {task: right / total for task, (right, total) in sorted(by_task.items())}


class TokenTally:
    """Mean visual_tokens_kept per image, by image kind, per budget weighting and keep ratio
    (successful requests whose counts match their images)."""

    def __init__(self) -> None:
        self.sums: dict[tuple[str, float], dict[str, list[float]]] = {}

    def add(self, keep_ratio: float, items: list[Item], answers: list[Answer], budget: str = DEFAULT_BUDGET) -> None:
        kinds = self.sums.setdefault((budget, float(keep_ratio)), {k: [0.0, 0] for k in KINDS})
        for item, a in zip(items, answers, strict=True):
            if a.error is not None or len(a.kept) != len(item.kinds):
                continue
            for kind, n in zip(item.kinds, a.kept):
                s = kinds.setdefault(kind, [0.0, 0])
                s[0] += n
                s[1] += 1

    def means(self, keep_ratio: float, budget: str = DEFAULT_BUDGET) -> dict[str, float | None]:
        return {kind: (total / count if count else None)
                for kind, (total, count) in self.sums[(budget, float(keep_ratio))].items()}

    def by_keep(self, budget: str = DEFAULT_BUDGET) -> dict[str, dict[str, float | None]]:
        keeps = sorted((k for b, k in self.sums if b == budget), reverse=True)
        return {keep_key(k): self.means(k, budget) for k in keeps}

    def by_budget(self) -> dict[str, dict[str, dict[str, float | None]]]:
        """Other weightings than the default, each by keep ratio."""
        return {b: self.by_keep(b) for b in sorted({b for b, _ in self.sums} - {DEFAULT_BUDGET})}

    def headline(self) -> dict[str, float | None]:
        """Default weighting, at HEADLINE_KEEP when it ran, else at the smallest keep ratio run."""
        keeps = [k for b, k in self.sums if b == DEFAULT_BUDGET]
        if not keeps:
            return {kind: None for kind in KINDS}
        return self.means(HEADLINE_KEEP if HEADLINE_KEEP in keeps else min(keeps))


def keep_key(keep_ratio: float) -> str:
    return repr(float(keep_ratio))  # 1.0 -> "1.0", 0.6 -> "0.6"


ROUTING_COUNTERS = ("zipmoe_moe_layer_steps_total", "zipmoe_moe_union_before_total", "zipmoe_moe_union_after_total",
                    "zipmoe_moe_rerouted_slots_total", "zipmoe_decode_tokens_total",
                    "zipmoe_decode_tokens_beside_prompts_total")


def routing_effect(before: dict[str, float], after: dict[str, float]) -> dict[str, float | None]:
    """Decode routing between two scrapes of the server's counters: distinct experts per MoE layer-step
    as routed and as computed (the weights read), slots moved per generated token (all layers); None
    where nothing was decoded. A token decoded beside a prompt chunk (top-K, truncated under truncate:
    runner.py) makes no layer-step and moves nothing; beside_prompts is their share."""
    d = counter_deltas(before, after, ROUTING_COUNTERS)
    steps, tokens = d["zipmoe_moe_layer_steps_total"], d["zipmoe_decode_tokens_total"]
    return {"experts_routed": d["zipmoe_moe_union_before_total"] / steps if steps else None,
            "experts_read": d["zipmoe_moe_union_after_total"] / steps if steps else None,
            "moved_per_token": d["zipmoe_moe_rerouted_slots_total"] / tokens if tokens else None,
            "beside_prompts": d["zipmoe_decode_tokens_beside_prompts_total"] / tokens if tokens else None}


def make_row(setting: Setting, keep_ratio: float, items: list[Item], answers: list[Answer], seconds: float,
             effect: dict[str, float | None] | None = None) -> dict:
    acc, by_task = accuracy(items, answers)
    errors = [a.error for a in answers if a.error is not None]
    effect = effect or routing_effect({}, {})
    return {"keep_ratio": float(keep_ratio), **setting.fields, "accuracy": acc, "by_task": by_task,
            "seconds": round(seconds, 3), "failed": len(errors), "first_error": errors[0] if errors else None,
            **{k: None if v is None else round(v, 3) for k, v in effect.items()}}


def result_json(split: str, n: int, checkpoint: str, rows: list[dict], tally: TokenTally,
                overrides: dict[str, dict[str, str]] | None = None) -> dict:
    return {"split": split, "n": n, "checkpoint": checkpoint, "overrides": overrides or {}, "rows": rows,
            "tokens_kept": tally.headline(),
            "tokens_kept_by_keep": tally.by_keep(), "tokens_kept_by_budget": tally.by_budget()}


def _write_json(result: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(result, indent=1, ensure_ascii=False) + "\n")
    tmp.replace(path)


# ------------------------------------------------------------------------------------------ running

def run_eval(checkpoint: str | Path | None = None, split: str = "test", n: int = 200, concurrency: int = 16,
             max_tokens: int | None = None, settings: str | list[tuple[Setting, tuple[float, ...]]] = "full",
             out: str | Path | None = DEFAULT_OUT,
             log_dir: str | Path | None = None, items: list[Item] | None = None,
             repository: str | Path = serve.DEFAULT_REPOSITORY, ready_timeout: float = 1800,
             overrides: dict[str, dict[str, str]] | None = None, taskset: str = "notes") -> dict:
    """Runs the plan (one server per setting), writes OUT.json / OUT.png when `out` is given, prints
    a table; returns the result dict. `settings`: full | quick | keep, or the plan itself, [(setting,
    keep ratios)]; `items` replaces the split's examples; `overrides` {model: {parameter: value}}
    apply to every server; `taskset` notes | v2 (max_tokens None: the task set's default)."""
    from zipmoe.clients.eval_taskset_v2 import taskset_named

    ts = taskset_named(taskset)
    max_tokens = ts.max_tokens if max_tokens is None else max_tokens
    steps = plan(settings) if isinstance(settings, str) else list(settings)
    overrides = overrides or {}
    per_server = [server_overrides(setting, overrides) for setting, _ in steps]  # clashes fail before any server
    checkpoint = resolve_checkpoint(checkpoint)
    if items is None:
        items = ts.load_items(split, n)
    if any(r.policy == "sere" for r, _ in steps):
        ensure_sere(checkpoint)
    log_dir = Path(log_dir) if log_dir is not None else Path(tempfile.mkdtemp(prefix="zipmoe-eval-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    if out is not None:
        out = Path(out)
        out = out.with_suffix("") if out.suffix in (".json", ".png") else out
    json_path = None if out is None else out.with_name(out.name + ".json")
    print(f"{len(items)} examples of {split}, {sum(len(k) for _, k in steps)} settings on {len(steps)} servers; "
          f"server logs in {log_dir}", flush=True)

    rows: list[dict] = []
    tally = TokenTally()
    for (setting, keeps), server_params in zip(steps, per_server):
        log = log_dir / f"server-{setting.slug}.log"
        ports = serve.free_server_ports()
        try:
            with serve.TritonServer(repository, checkpoint=str(checkpoint), log_path=log,
                                    overrides=server_params, **ports) as server:
                server.wait_ready(timeout=ready_timeout)
                for keep in keeps:
                    before = scrape_metrics(server.url_metrics)
                    answers, seconds = run_setting(server.url_grpc, items, keep, concurrency, max_tokens)
                    # Settled: the decoder counts a step that ran past a request's end once it is read back.
                    effect = routing_effect(before, settled(lambda: scrape_metrics(server.url_metrics)))
                    row = ts.make_row(setting, keep, items, answers, seconds, effect)
                    tally.add(keep, items, answers, setting.budget)
                    rows.append(row)
                    print(f"keep {keep_key(keep)} {row_label(row)}: accuracy {row['accuracy']:.3f} ({seconds:.1f} s)"
                          + (f", {row['failed']} failed: {row['first_error']} (server log: {log})"
                             if row["failed"] else ""), flush=True)
        except BaseException:
            print(f"stopped at {row_label(setting.fields)}; server log: {log}", file=sys.stderr, flush=True)
            raise
        result = ts.result_json(split, len(items), display_path(checkpoint), rows, tally, overrides)
        if json_path is not None:
            _write_json(result, json_path)  # what was measured survives a later failure

    result = ts.result_json(split, len(items), display_path(checkpoint), rows, tally, overrides)
    print(ts.table(result))
    if out is not None:
        print(f"wrote {json_path}")
        png = out.with_name(out.name + ".png")
        write_plot(result, png, functools.partial(plot, metric=ts.metric))
    return result


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", default=None, help="checkpoint directory (default: checkpoints/notes, trained)")
    p.add_argument("--split", default="test", help="notes_data / taskset_v2 split (default: test)")
    p.add_argument("--n", type=int, default=200, help="examples (default: 200)")
    p.add_argument("--concurrency", type=int, default=16, help="requests in flight (default: 16)")
    p.add_argument("--taskset", choices=("notes", "v2"), default="notes",
                   help="notes: notes_data, exact match; v2: build/taskset_v2.py, exact match and token F1")
    p.add_argument("--max-tokens", type=int, default=None, help="tokens generated per answer (default: 8; v2: 48)")
    sizes = {s: f"{sum(len(k) for _, k in plan(s))} settings on {len(plan(s))} servers" for s in PLANS}
    p.add_argument("--settings", choices=PLANS, default="full",
                   help=f"full: both sweeps ({sizes['full']}); quick: a smoke test ({sizes['quick']}); "
                        f"keep: the keep-ratio sweep alone ({sizes['keep']}); core: issue 18's rows ({sizes['core']})")
    p.add_argument("--set", action="append", default=[], dest="overrides", metavar="MODEL.PARAMETER=VALUE",
                   help="a config.pbtxt parameter for every server (repeatable)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT,
                   help="writes OUT.json and OUT.png (default: docs/results/quality)")
    p.add_argument("--log-dir", type=Path, default=None, help="server logs (default: a new temporary folder)")


def run(args: argparse.Namespace) -> int:
    from zipmoe.clients.eval_taskset_v2 import taskset_named

    v2 = {"taskset": args.taskset} if args.taskset != "notes" else {}  # notes: the call as before
    max_tokens = taskset_named(args.taskset).max_tokens if args.max_tokens is None else args.max_tokens
    run_eval(args.checkpoint, args.split, args.n, args.concurrency, max_tokens, args.settings, args.out,
             args.log_dir, overrides=repository_config.parse_overrides(args.overrides), **v2)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m zipmoe.clients.eval_quality", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
