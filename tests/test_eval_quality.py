"""`zipmoe eval`: scoring and aggregation, the settings plan, the CLI, and runs against a real server."""
from __future__ import annotations

import importlib.util
import json

import pytest
from conftest import REPO

from zipmoe import cli, repository_config, serve
from zipmoe.clients import eval_quality as eq
from zipmoe.clients import eval_quality_report as report
from zipmoe.clients.eval_quality import Answer, Item
from zipmoe.clients.triton_client import scrape_metrics

HAS_MPL = importlib.util.find_spec("matplotlib") is not None
ROW_KEYS = {"keep_ratio", "routing", "primary_k", "rho", "protect", "budget", "accuracy", "by_task", "seconds",
            "failed", "first_error", "experts_routed", "experts_read", "moved_per_token", "beside_prompts"}


def check_schema(result: dict, n: int) -> None:
    assert set(result) == {"split", "n", "checkpoint", "overrides", "rows", "tokens_kept", "tokens_kept_by_keep",
                           "tokens_kept_by_budget"}
    assert result["n"] == n and isinstance(result["split"], str) and isinstance(result["checkpoint"], str)
    for row in result["rows"]:
        assert set(row) == ROW_KEYS
        assert 0.0 <= row["accuracy"] <= 1.0 and all(0.0 <= v <= 1.0 for v in row["by_task"].values())
        assert row["seconds"] >= 0 and row["failed"] == 0 and row["first_error"] is None
        assert row["experts_read"] is not None and 1 <= row["experts_read"] <= row["experts_routed"]
        assert row["moved_per_token"] >= 0 and 0 <= row["beside_prompts"] <= 1
    assert set(result["tokens_kept"]) >= {"dense", "plain"}
    keeps = {eq.keep_key(r["keep_ratio"]) for r in result["rows"]}
    assert set(result["tokens_kept_by_keep"]) == keeps
    for kinds in result["tokens_kept_by_keep"].values():
        assert set(kinds) >= {"dense", "plain"} and all(v is None or v > 0 for v in kinds.values())


# ------------------------------------------------------------------------------------------ unit

@pytest.mark.parametrize("text, want", [
    ("  Red.\n", "red"), ("42", "42"), ("42 .", "42"), ("3..", "3."), ("蓝色。", "蓝色"), ("", ""), (".", ""),
    ("Circle", "circle"),
])
def test_normalize(text, want):
    assert eq.normalize(text) == want


def test_exact_match_normalises_both_sides():
    assert eq.exact_match(" Triangle.", "triangle")
    assert eq.exact_match("17", "17.")
    assert not eq.exact_match("17 dollars", "17")
    assert not eq.exact_match("", "17")


def test_plans():
    full = eq.plan("full")
    assert len(full) == 17 and sum(len(keeps) for _, keeps in full) == 24
    settings = [s for s, _ in full]
    assert len(set(settings)) == 17
    assert full[0] == (eq.TOPK, eq.KEEP_RATIOS) and full[1] == (eq.TOPK_BY_SIZE, (0.7, 0.6, 0.5, 0.3))
    assert all(keeps == (1.0,) for _, keeps in full[2:])
    assert [s.name for s in settings].count("topk") == 2  # topk at keep 1.0 runs once for both sweeps
    assert [s.budget for s in settings].count("size") == 1
    sere = {(r.primary_k, r.rho, r.protect) for r in settings if r.name == "sere"}
    assert sere == {(k, rho, p) for k in (1, 2) for rho in (0.0, 0.3, 0.5) for p in (True, False)}
    top2 = next(r for r in settings if r.name == "top2")
    assert top2.overrides == {"moe_decoder": {"routing_policy": "truncate", "truncate_k": "2"},
                              "vision_encoder": {"budget_weighting": "distinct"}}
    assert top2.fields == {"routing": "top2", "primary_k": 2, "rho": None, "protect": None, "budget": "distinct"}
    assert eq.TOP1.overrides["moe_decoder"] == {"routing_policy": "truncate", "truncate_k": "1"}
    assert eq.sere(1, 0.3, False).overrides["moe_decoder"] == {
        "routing_policy": "sere", "sere_primary_k": "1", "sere_threshold": "0.3", "sere_protect": "false"}
    assert eq.TOPK_BY_SIZE.overrides["vision_encoder"] == {"budget_weighting": "size"}
    assert eq.plan("quick") == [(eq.TOPK, (1.0, 0.5)), (eq.TOP2, (1.0,)), (eq.sere(2, 0.5, True), (1.0,))]
    assert len({s.slug for s in settings}) == 17  # one log file per server
    assert eq.TOPK_BY_SIZE.slug == "topk-budget-size"
    assert eq.plan("keep") == [(eq.TOPK, eq.KEEP_RATIOS)]
    core = eq.plan("core")  # issue 18's rows: a subset of full's settings, one server each
    assert {s for s, _ in core} <= {s for s, _ in full}
    assert core == [(eq.TOPK, (1.0, 0.6)), (eq.TOP2, (1.0,)), (eq.sere(2, 0.5, True), (1.0,))]
    with pytest.raises(ValueError):
        eq.plan("everything")


def test_set_overrides_join_every_server_but_never_what_is_swept():
    extra = {"vision_encoder": {"min_tokens_per_image": "8"}, "moe_decoder": {"max_num_seqs": "32"}}
    merged = eq.server_overrides(eq.sere(2, 0.5, True), extra)
    assert merged["vision_encoder"] == {"min_tokens_per_image": "8", "budget_weighting": "distinct"}
    assert merged["moe_decoder"]["max_num_seqs"] == "32" and merged["moe_decoder"]["routing_policy"] == "sere"
    assert extra == {"vision_encoder": {"min_tokens_per_image": "8"}, "moe_decoder": {"max_num_seqs": "32"}}
    with pytest.raises(ValueError, match="moe_decoder.routing_policy"):
        eq.server_overrides(eq.TOPK, {"moe_decoder": {"routing_policy": "sere"}})
    result = eq.result_json("test", 1, "ckpt", [], eq.TokenTally(), {"vision_encoder": {"min_tokens_per_image": "8"}})
    assert "n=1, with vision_encoder.min_tokens_per_image=8" in report.table(result)


def test_plan_overrides_name_real_parameters(tmp_path):
    """Every parameter a setting sets exists in its model's config.pbtxt (rendering refuses unknown ones)."""
    for setting, _ in eq.plan("full"):
        repository_config.render_repository(serve.DEFAULT_REPOSITORY, tmp_path / setting.slug, None, setting.overrides)


ITEMS = [Item("q1", "Red", "colour", ("dense", "plain"), (b"a", b"b")),
         Item("q2", "17", "read_price", ("dense", "plain", "plain"), (b"a", b"b", b"c")),
         Item("q3", "3", "count", ("plain", "dense"), (b"a", b"b")),
         Item("q4", "blue", "colour", ("dense", "plain"), (b"a", b"b"))]


def test_accuracy_rows_and_token_means():
    answers = [Answer("red.", True, [10, 4]), Answer("18", False, [12, 2, 6]),
               Answer(error="ServerError: boom"), Answer("Blue", True, [9])]  # counts not one per image
    acc, by_task = eq.accuracy(ITEMS, answers)
    assert acc == 0.5 and by_task == {"colour": 1.0, "count": 0.0, "read_price": 0.0}
    effect = {"experts_routed": 7.5, "experts_read": 5.0, "moved_per_token": 1.23456}
    row = eq.make_row(eq.sere(2, 0.5, True), 1.0, ITEMS, answers, 1.23456, effect)
    assert row == {"keep_ratio": 1.0, "routing": "sere", "primary_k": 2, "rho": 0.5, "protect": True,
                   "budget": "distinct", "accuracy": 0.5, "by_task": by_task, "seconds": 1.235, "failed": 1,
                   "first_error": "ServerError: boom", "experts_routed": 7.5, "experts_read": 5.0,
                   "moved_per_token": 1.235}
    tally = eq.TokenTally()
    tally.add(1.0, ITEMS, answers)  # the failed request and the mismatched counts are left out
    assert tally.means(1.0) == {"dense": 11.0, "plain": 4.0}
    assert eq.accuracy([], []) == (0.0, {})


def test_tokens_kept_headline():
    tally = eq.TokenTally()
    assert tally.headline() == {"dense": None, "plain": None} and tally.by_keep() == {}
    for keep, n in ((1.0, 20), (0.5, 10), (0.3, 6)):
        tally.add(keep, ITEMS[:1], [Answer("x", False, [n, n // 2])])
    assert tally.headline() == {"dense": 6.0, "plain": 3.0}  # no 0.6: the smallest keep ratio
    tally.add(0.6, ITEMS[:1], [Answer("x", False, [12, 6])])
    assert tally.headline() == {"dense": 12.0, "plain": 6.0}
    assert list(tally.by_keep()) == ["1.0", "0.6", "0.5", "0.3"]
    tally.add(0.7, ITEMS[2:3], [Answer("x", False, [5, 9])])
    assert tally.means(0.7) == {"dense": 9.0, "plain": 5.0}
    only_plain = eq.TokenTally()
    only_plain.add(1.0, [Item("q", "a", "t", ("plain",), (b"a",))], [Answer("x", False, [7])])
    assert only_plain.by_keep() == {"1.0": {"dense": None, "plain": 7.0}}


def test_routing_effect_from_counters():
    before = {"zipmoe_moe_layer_steps_total": 8.0, "zipmoe_moe_union_before_total": 40.0,
              "zipmoe_moe_union_after_total": 40.0, "zipmoe_moe_rerouted_slots_total": 0.0,
              "zipmoe_decode_tokens_total": 2.0, "zipmoe_decode_tokens_beside_prompts_total": 1.0}
    after = {"zipmoe_moe_layer_steps_total": 48.0, "zipmoe_moe_union_before_total": 340.0,
             "zipmoe_moe_union_after_total": 240.0, "zipmoe_moe_rerouted_slots_total": 60.0,
             "zipmoe_decode_tokens_total": 22.0, "zipmoe_decode_tokens_beside_prompts_total": 6.0}
    assert eq.routing_effect(before, after) == {"experts_routed": 7.5, "experts_read": 5.0, "moved_per_token": 3.0,
                                                "beside_prompts": 0.25}
    assert eq.routing_effect(after, after) == {"experts_routed": None, "experts_read": None, "moved_per_token": None,
                                               "beside_prompts": None}


def test_tokens_kept_per_budget_weighting():
    tally = eq.TokenTally()
    tally.add(0.5, ITEMS[:1], [Answer("x", False, [12, 4])])
    tally.add(0.5, ITEMS[:1], [Answer("x", False, [8, 8])], budget="size")
    assert tally.headline() == {"dense": 12.0, "plain": 4.0}  # the default weighting
    assert tally.by_keep("size") == {"0.5": {"dense": 8.0, "plain": 8.0}}
    assert tally.by_budget() == {"size": {"0.5": {"dense": 8.0, "plain": 8.0}}}
    row = eq.make_row(eq.TOPK_BY_SIZE, 0.5, ITEMS[:1], [Answer("x", False, [8, 8])], 1.0)
    assert row["budget"] == "size" and report.row_label(row) == "topk, budget by size"
    result = eq.result_json("test", 1, "ckpt", [row], tally)
    assert "budget by size: keep 0.5: dense 8.0, plain 8.0" in report.table(result)


def test_table_and_plot(tmp_path):
    tally = eq.TokenTally()
    rows = []
    for routing, keep, answers in (
            (eq.TOPK, 1.0, [Answer("red", True, [10, 4])] * 4),
            (eq.TOPK, 0.6, [Answer("x", False, [6, 2])] * 4),
            (eq.TOPK_BY_SIZE, 0.6, [Answer("red", True, [5, 3])] * 4),
            (eq.TOP2, 1.0, [Answer(error="ServerError: boom")] * 4),
            (eq.sere(1, 0.0, False), 1.0, [Answer("red", True, [10, 4])] * 4),
            (eq.OEA, 1.0, [Answer("x", False, [10, 4])] * 4)):
        items = [ITEMS[0]] * 4
        rows.append(eq.make_row(routing, keep, items, answers, 2.0))
        tally.add(keep, items, answers, routing.budget)
    result = eq.result_json("test", 4, "checkpoints/tiny", rows, tally)
    assert result["tokens_kept"] == {"dense": 6.0, "plain": 2.0}
    assert result["tokens_kept_by_budget"] == {"size": {"0.6": {"dense": 5.0, "plain": 3.0}}}
    text = report.table(result)
    assert "sere" in text and "oea" in text and "keep 1.0 top2: 4 requests failed, first: ServerError: boom" in text
    assert "keep 0.6: dense 6.0, plain 2.0" in text
    assert report.row_label(rows[4]) == "sere K'=1 ρ=0 -P" and report.row_label(rows[5]) == "oea k0=2"
    if HAS_MPL:
        assert report.plot(result, tmp_path / "q.png") and (tmp_path / "q.png").stat().st_size > 1000


def test_table_gives_the_experts_saved_in_the_rows_own_steps():
    result = json.loads((REPO / "docs" / "results" / "quality_v2.json").read_text())
    sere = next(r for r in result["rows"] if r["routing"] == "sere")
    assert report.experts_saved(sere) == pytest.approx(100 * (1 - sere["experts_read"] / sere["experts_routed"]))
    assert report.experts_saved(result["rows"][0]) == 0.0
    assert report.experts_saved({**sere, "experts_routed": None}) is None  # no metrics scraped
    line = next(ln for ln in report.table(result).splitlines() if " sere " in ln)
    assert f" {report.experts_saved(sere):.1f} " in line


def test_ask_reports_a_failed_request():
    answer = eq.ask(f"127.0.0.1:{serve.free_port()}", ITEMS[0], 1.0, 4, timeout=20)  # nothing listens there
    assert answer.error and not answer.correct and answer.text is None


def test_cli_eval_arguments(monkeypatch, tmp_path):
    calls = []
    monkeypatch.setattr(eq, "run_eval", lambda *a, **k: calls.append((a, k)))
    assert cli.main(["eval", "--settings", "quick", "--n", "4", "--concurrency", "2", "--out", str(tmp_path / "q"),
                     "--checkpoint", "ckpt", "--max-tokens", "6", "--split", "validation",
                     "--set", "vision_encoder.min_tokens_per_image=8"]) == 0
    assert calls == [(("ckpt", "validation", 4, 2, 6, "quick", tmp_path / "q", None),
                      {"overrides": {"vision_encoder": {"min_tokens_per_image": "8"}}})]
    assert cli.main(["eval"]) == 0
    assert calls[1] == ((None, "test", 200, 16, 8, "full", eq.DEFAULT_OUT, None), {"overrides": {}})


# ----------------------------------------------------------------------------------- integration

@pytest.mark.integration
def test_settings_against_server(zipmoe_server, tmp_path):
    """Two keep ratios over 4 test examples on the shared (topk) server: both sweeps, tokens by kind."""
    items = eq.load_items("test", 4)
    assert all(len(it.images) == len(it.kinds) >= 2 for it in items)
    tally, rows, kept_total = eq.TokenTally(), [], {}
    for keep in (1.0, 0.5):
        before = scrape_metrics(zipmoe_server.url_metrics)
        answers, seconds = eq.run_setting(zipmoe_server.url_grpc, items, keep, concurrency=4, max_tokens=4)
        effect = eq.routing_effect(before, scrape_metrics(zipmoe_server.url_metrics))
        assert effect["experts_read"] == effect["experts_routed"] and effect["moved_per_token"] == 0  # topk
        assert [a.error for a in answers] == [None] * 4 and all(isinstance(a.text, str) for a in answers)
        assert [len(a.kept) for a in answers] == [len(it.images) for it in items]
        kept_total[keep] = sum(sum(a.kept) for a in answers)
        rows.append(eq.make_row(eq.TOPK, keep, items, answers, seconds, effect))
        tally.add(keep, items, answers)
    assert kept_total[0.5] < kept_total[1.0]
    result = eq.result_json("test", 4, "checkpoints/tiny", rows, tally)
    check_schema(result, 4)
    assert result["tokens_kept"] == result["tokens_kept_by_keep"]["0.5"]  # no 0.6 run: the smallest
    assert [r["keep_ratio"] for r in rows if r["routing"] == "topk"] == [1.0, 0.5]  # sweep (a)
    assert [r["routing"] for r in rows if r["keep_ratio"] == 1.0] == ["topk"]  # sweep (b)
    if HAS_MPL:
        assert report.plot(result, tmp_path / "q.png")


@pytest.mark.integration
def test_run_eval_one_server(tiny_checkpoint, tmp_path):
    """The server loop with one configuration (sere, calibrated when needed): JSON, PNG, logs."""
    plan = [(eq.sere(2, 0.5, True), (1.0, 0.6))]
    result = eq.run_eval(tiny_checkpoint, "test", 4, concurrency=4, max_tokens=4, settings=plan,
                         out=tmp_path / "quality", log_dir=tmp_path / "logs")
    check_schema(result, 4)
    assert json.loads((tmp_path / "quality.json").read_text()) == result
    assert [(r["routing"], r["keep_ratio"], r["primary_k"], r["rho"], r["protect"]) for r in result["rows"]] == [
        ("sere", 1.0, 2, 0.5, True), ("sere", 0.6, 2, 0.5, True)]
    assert result["tokens_kept"] == result["tokens_kept_by_keep"]["0.6"]
    assert result["checkpoint"] == "checkpoints/tiny"
    assert (tmp_path / "logs" / "server-sere-k2-rho0.5-protect.log").stat().st_size > 0
    assert (tmp_path / "quality.png").exists() == HAS_MPL
