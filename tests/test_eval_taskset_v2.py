"""`zipmoe eval --taskset v2`: v2 items, exact/F1 rows, the CLI option, and a run through a real
server on the v2 smoke checkpoint (conftest's v2_smoke)."""
from __future__ import annotations

import json

import pytest

from zipmoe import cli
from zipmoe.build import taskset_v2
from zipmoe.clients import eval_quality as eq
from zipmoe.clients import eval_taskset_v2 as v2
from zipmoe.clients.eval_quality import Answer, Item

V2_ROW_KEYS = {"keep_ratio", "routing", "primary_k", "rho", "protect", "exact", "f1", "experts_read_per_layer_step"}


def check_v2_schema(result: dict, n: int, keeps: list[float]) -> None:
    """The shape issue 18 asks for: {split, n, rows: [...], tokens_kept: {dense, plain}}."""
    assert {"split", "n", "rows", "tokens_kept"} <= set(result) and result["taskset"] == "v2"
    assert result["n"] == n and [r["keep_ratio"] for r in result["rows"]] == keeps
    for row in result["rows"]:
        assert V2_ROW_KEYS <= set(row)
        assert 0.0 <= row["exact"] <= 1.0 and 0.0 <= row["f1"] <= 1.0 and row["exact"] <= row["f1"]
        assert row["accuracy"] == row["exact"]
        assert all(0.0 <= v <= 1.0 for v in row["f1_by_task"].values()) and set(row["f1_by_task"]) <= set(
            taskset_v2.TASKS)
        assert row["failed"] == 0, row["first_error"]
        # None when no decode step ran (the smoke checkpoint's first token is often <|im_end|>). A token
        # decoded inside a step that also prefills another prompt runs plain top-K: it counts in moved's
        # denominator but makes no layer-step, so tokens without layer-steps are possible, not the reverse.
        read = row["experts_read_per_layer_step"]
        assert read == row["experts_read"] and (read is None or row["moved_per_token"] is not None)
        assert read is None or read >= 1
    assert set(result["tokens_kept"]) == {"dense", "plain"}
    assert all(v is not None and v > 0 for v in result["tokens_kept"].values())


def test_load_items_are_taskset_v2_examples_as_png():
    items = v2.load_items("test", 2, start=1)
    examples = taskset_v2.examples("test", 2, start=1)
    for item, ex in zip(items, examples, strict=True):
        assert (item.question, item.answer, item.task, item.kinds) == (ex.question, ex.answer, ex.task, ex.kinds)
        assert len(item.images) == len(ex.images) and all(im.startswith(b"\x89PNG") for im in item.images)


def test_rows_score_exact_and_f1():
    items = [Item("q1", "MILK 1.99, EGGS 2.79", "receipt_list", ("dense", "plain")),
             Item("q2", "BREAD 3.49", "receipt_line", ("dense", "plain")),
             Item("q3", "TEA 4.10", "receipt_line", ("plain", "dense")),
             Item("q4", "FRESH MART, TEA 3.15", "store_price", ("dense", "plain"))]
    answers = [Answer("MILK 1.99, EGGS 2.97", True, [300, 40]), Answer("bread 3.49.", False, [200, 30]),
               Answer(error="ServerError: boom"), Answer("FRESH MART, TEA 3.15", True, [200, 30])]
    effect = {"experts_routed": 7.5, "experts_read": 5.0, "moved_per_token": 0.5}
    row = v2.make_row(eq.TOPK, 0.6, items, answers, 2.0, effect)
    assert [a.correct for a in answers] == [False, True, False, True]  # quality_metrics' exact match
    assert row["exact"] == row["accuracy"] == pytest.approx(2 / 4, abs=1e-4)
    assert row["f1"] == pytest.approx((0.75 + 1.0 + 0.0 + 1.0) / 4, abs=1e-4)
    assert row["f1_by_task"] == {"receipt_line": 0.5, "receipt_list": 0.75, "store_price": 1.0}
    assert row["f1_by_group"] == {"knowledge": 1.0, "reading": pytest.approx(1.75 / 3)}
    assert row["experts_read_per_layer_step"] == 5.0 and row["failed"] == 1
    tally = eq.TokenTally()
    tally.add(0.6, items, answers)
    result = v2.result_json("test", 4, "ckpt", [row], tally)
    assert result["taskset"] == "v2"
    assert result["tokens_kept"] == {"dense": pytest.approx(700 / 3), "plain": pytest.approx(100 / 3)}
    assert "F1 0.688, exact 0.500, knowledge 1.000, reading 0.583" in v2.table(result)


def test_taskset_names():
    assert v2.taskset_named("notes").make_row is eq.make_row and v2.taskset_named("notes").max_tokens == 8
    assert v2.taskset_named("v2").max_tokens == 48 and v2.taskset_named("v2").metric == "f1"
    with pytest.raises(ValueError):
        v2.taskset_named("v3")


def test_cli_taskset_v2(monkeypatch):
    calls = []
    monkeypatch.setattr(eq, "run_eval", lambda *a, **k: calls.append((a, k)))
    assert cli.main(["eval", "--taskset", "v2", "--checkpoint", "ckpt", "--n", "4"]) == 0
    assert calls[0] == (("ckpt", "test", 4, 16, 48, "full", eq.DEFAULT_OUT, None),
                        {"overrides": {}, "taskset": "v2"})
    assert cli.main(["eval", "--taskset", "v2", "--max-tokens", "20"]) == 0
    assert calls[1][0][4] == 20
    assert eq.main(["--taskset", "notes", "--n", "3"]) == 0  # python -m zipmoe.clients.eval_quality
    assert calls[2] == ((None, "test", 3, 16, 8, "full", eq.DEFAULT_OUT, None), {"overrides": {}})


@pytest.mark.integration
def test_run_eval_v2_on_the_smoke_checkpoint(v2_smoke, tmp_path):
    """2 test examples of v2 (5 images) at keep 1.0 and 0.5 through one topk server on the smoke
    checkpoint (about 25 s on two idle cores, plus the shared smoke training)."""
    checkpoint = v2_smoke[0]
    result = eq.run_eval(checkpoint, "test", 2, concurrency=2, max_tokens=4, settings=[(eq.TOPK, (1.0, 0.5))],
                         out=tmp_path / "quality_v2", log_dir=tmp_path / "logs", taskset="v2",
                         ready_timeout=300)
    check_v2_schema(result, 2, [1.0, 0.5])
    assert json.loads((tmp_path / "quality_v2.json").read_text()) == result
    by_keep = result["tokens_kept_by_keep"]
    assert by_keep["0.5"]["dense"] < by_keep["1.0"]["dense"]
    assert result["tokens_kept"] == by_keep["0.5"]  # no 0.6 run: the smallest keep ratio
