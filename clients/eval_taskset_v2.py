"""Task set v2 in the quality harness (issue 18): `zipmoe eval --taskset v2`.

    zipmoe eval --taskset v2 --checkpoint checkpoints/v2 [--split test] [--n 200] [--settings quick] ...

Where the data comes from: `build/taskset_v2.py` (`examples(split, n, start)`: 2-4 images of
448-896 px, "dense" or "plain" each, a question, a reference answer of 5-40 tokens), sent as PNG
bytes (`taskset_v2.png_bytes`) through `clients/eval_quality.py`'s server loop (`run_eval`), which
asks the `mm_qa` ensemble and reads back the text and `visual_tokens_kept` per image.
How it is scored: `clients/quality_metrics.py`'s `best_score` (SQuAD-normalised exact match and
token F1) per answer; a failed request scores 0 on both.
Where it goes: each row of eval_quality's result gains `exact`, `f1`, `f1_by_task`, `f1_by_group`
(knowledge questions, answered from the weights, and reading ones) and `experts_read_per_layer_step`
(the server's distinct experts computed per MoE layer-step); its
`accuracy` / `by_task` are the same exact match (so eval_quality's table keeps working); the result
is eval_quality's (`tokens_kept: {dense, plain}` per image kind) plus `"taskset": "v2"`, written as
OUT.json and OUT.png (F1 bars) by `run_eval`. `taskset_named` gives run_eval either task set
(notes: eval_quality's own functions).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from zipmoe.build import taskset_v2
from zipmoe.clients import eval_quality as eq
from zipmoe.clients import eval_quality_report as report
from zipmoe.clients.quality_metrics import best_score, mean_scores

MAX_TOKENS = 48  # v2 answers are up to 31 tokens of the trained tokenizer, plus <|im_end|>


def task_group(task: str) -> str:
    """A routing policy that drops expert capacity shows in the knowledge group (recalled prices);
    the reading group copies what attention reads, and any expert serves it (docs/QUALITY.md)."""
    return "knowledge" if task in taskset_v2.KNOWLEDGE_TASKS else "reading"


def load_items(split: str, n: int, start: int = 0) -> list[eq.Item]:
    """Examples `start`..`start + n - 1` of a task set v2 split, images as PNG bytes."""
    return [eq.Item(ex.question, ex.answer, ex.task, tuple(ex.kinds),
                    tuple(taskset_v2.png_bytes(im) for im in ex.images))
            for ex in taskset_v2.examples(split, n, start)]


def rescore(items: list[eq.Item], answers: list[eq.Answer]) -> list[tuple[float, float]]:
    """(exact, F1) per answer by quality_metrics, also setting Answer.correct to that exact match."""
    scores = []
    for item, a in zip(items, answers, strict=True):
        exact, f1 = (0.0, 0.0) if a.text is None else best_score(a.text, item.answer)
        a.correct = bool(exact)
        scores.append((exact, f1))
    return scores


def make_row(setting: eq.Setting, keep_ratio: float, items: list[eq.Item], answers: list[eq.Answer],
             seconds: float, effect: dict[str, float | None] | None = None) -> dict:
    """eval_quality's row with exact match and token F1 (overall, per task and per group)."""
    rescore(items, answers)
    row = eq.make_row(setting, keep_ratio, items, answers, seconds, effect)
    pairs = [(a.text, item.answer) for item, a in zip(items, answers, strict=True)]

    def f1_by(key) -> dict[str, float]:
        grouped: dict[str, list] = {}
        for item, pair in zip(items, pairs):
            grouped.setdefault(key(item.task), []).append(pair)
        return {k: mean_scores(v)["f1"] for k, v in sorted(grouped.items())}

    overall = mean_scores(pairs)
    return {**row, "exact": overall["exact"], "f1": overall["f1"], "f1_by_task": f1_by(lambda task: task),
            "f1_by_group": f1_by(task_group), "experts_read_per_layer_step": row["experts_read"]}


def result_json(split: str, n: int, checkpoint: str, rows: list[dict], tally: eq.TokenTally,
                overrides: dict[str, dict[str, str]] | None = None) -> dict:
    return {"taskset": "v2", **eq.result_json(split, n, checkpoint, rows, tally, overrides)}


def table(result: dict) -> str:
    """eval_quality's table (its accuracy column is exact match) and each row's F1."""
    lines = [report.table(result), "token F1 (SQuAD-normalised; accuracy above is exact match):"]
    for r in result["rows"]:
        groups = "".join(f", {g} {v:.3f}" for g, v in r.get("f1_by_group", {}).items())  # none before session 33
        tasks = " ".join(f"{t}={v:.2f}" for t, v in r["f1_by_task"].items())
        lines.append(f"  keep {r['keep_ratio']:.2f} {report.row_label(r)}: F1 {r['f1']:.3f}, exact {r['exact']:.3f}"
                     f"{groups}  {tasks}")
    return "\n".join(lines)


@dataclass(frozen=True)
class TaskSet:
    """What eval_quality.run_eval takes from a task set: its examples, rows, result, table, the
    metric it plots and the default answer length."""
    load_items: Callable[..., list[eq.Item]]
    make_row: Callable[..., dict]
    result_json: Callable[..., dict]
    table: Callable[[dict], str]
    metric: str = "accuracy"
    max_tokens: int = 8


TASKSETS = {"notes": TaskSet(eq.load_items, eq.make_row, eq.result_json, report.table),
            "v2": TaskSet(load_items, make_row, result_json, table, metric="f1", max_tokens=MAX_TOKENS)}


def taskset_named(name: str) -> TaskSet:
    if name not in TASKSETS:
        raise ValueError(f"taskset must be one of {sorted(TASKSETS)}, got {name!r}")
    return TASKSETS[name]
