"""perf_analyzer_configs: the input-data files and their generator, the profile-export parser, and the
runner driving the real perf_analyzer (tritonclient 2.51) against the tiny-checkpoint servers.

Behaviour only: the files' contents, the parser's arithmetic on a made-up export, the rows' structure
and that measured numbers are finite and positive; never timings."""
from __future__ import annotations

import base64
import importlib.util
import json
import math
import os
from pathlib import Path

import numpy as np
import pytest
from tritonclient.utils import deserialize_bytes_tensor

from perf_analyzer_configs import deps, make_inputs, profile_export, report, run

# The row keys; the runner adds p90s, ITL p50/p90, e2e, req_s, experts_read, ...
ROW_KEYS = {"workload", "routing", "mode", "value", "n", "errors", "ttft_ms_p50", "ttft_ms_p99", "tpot_ms_p50",
            "tpot_ms_p99", "itl_ms_p99", "out_tok_s"}
MEASURED = ("ttft_ms_p50", "ttft_ms_p99", "tpot_ms_p50", "tpot_ms_p99", "itl_ms_p99", "out_tok_s", "req_s")


def positive(*values) -> bool:
    return all(isinstance(v, (int, float)) and math.isfinite(v) and v > 0 for v in values)


def images_of(entry: dict) -> list[bytes]:
    if "images" not in entry:
        return []
    raw = base64.b64decode(entry["images"]["b64"])
    return [bytes(b) for b in deserialize_bytes_tensor(raw)]


# -- input data -------------------------------------------------------------------------------------

def test_bytes_tensor_is_tritons_length_prefixed_serialisation():
    items = [b"\xff\xd8one", b"", b"three"]
    tensor = make_inputs.bytes_tensor(items)
    assert tensor["shape"] == [3]
    assert base64.b64decode(tensor["b64"])[:4] == (5).to_bytes(4, "little")  # each element: length, then bytes
    assert images_of({"images": tensor}) == items


@pytest.mark.parametrize("workload", make_inputs.WORKLOADS)
def test_committed_inputs_are_what_the_generator_writes(workload, tmp_path):
    """The files in inputs/ are the ci profile's output, byte for byte (regenerate them with the
    README's command after changing the generator)."""
    fresh = make_inputs.write(make_inputs.build(workload, make_inputs.PROFILES["ci"]), tmp_path / f"{workload}.json")
    assert fresh.read_bytes() == make_inputs.input_file(workload, "ci").read_bytes()


def test_every_request_streams_exactly_max_tokens_with_its_images():
    ci = make_inputs.PROFILES["ci"]
    for workload in make_inputs.WORKLOADS:
        data = json.loads(make_inputs.input_file(workload, "ci").read_text())["data"]
        assert len(data) == (ci.business_entries if workload == "business" else ci.entries)
        for entry in data:
            assert entry["stream"] == [True] and entry["ignore_eos"] == [True]
            images = images_of(entry)
            assert all(jpeg[:2] == b"\xff\xd8" for jpeg in images)
            assert len(images) == entry.get("images", {}).get("shape", [0])[0]
            if workload == "business":
                assert 1 <= len(images) <= 30 and ci.answer_tokens[0] <= entry["max_tokens"][0] <= ci.answer_tokens[1]
            else:
                assert len(images) == make_inputs.FIXED_IMAGES[workload] and entry["max_tokens"] == [ci.tokens]
    business = json.loads(make_inputs.input_file("business", "ci").read_text())["data"]
    every_image = [jpeg for entry in business for jpeg in images_of(entry)]
    assert len(set(every_image)) == len(every_image)  # distinct pictures: no cache hit on first use


def test_business_mix_follows_its_documented_distribution():
    full = make_inputs.PROFILES["full"]
    plan = make_inputs.shapes("business", full, 20000, seed=1)
    images, tokens = np.array([p[0] for p in plan]), np.array([p[1] for p in plan])
    assert images.min() == 1 and images.max() == 30 and tokens.min() == 64 and tokens.max() == 256
    for low, high, share in make_inputs.IMAGE_BUCKETS:
        assert abs(np.mean((images >= low) & (images <= high)) - share) < 0.015
    expected = sum(share * (low + high) / 2 for low, high, share in make_inputs.IMAGE_BUCKETS)
    assert abs(images.mean() - expected) < 0.15 and abs(expected - 6.9) < 0.05  # README: 6.9 images on average
    assert abs(tokens.mean() - 160) < 2  # README: 160 answer tokens on average
    assert make_inputs.shapes("business", full, 50, seed=1) == plan[:50]  # seeded


# -- the export parser ------------------------------------------------------------------------------

def response(count, finish=""):
    return {"output_token_count": count, "finish_reason": finish, "text_output": "x", "input_token_count": 9}


def test_export_rows_follow_bench_serving_conventions():
    ms = 1_000_000
    export = {"experiments": [{"experiment": {"mode": "request_rate", "value": 2.0}, "requests": [
        {"timestamp": 0, "request_inputs": {"max_tokens": 4, "ignore_eos": True},
         "response_timestamps": [10 * ms, 12 * ms, 14 * ms, 19 * ms, 20 * ms],
         # the last one is mm_qa_bls's empty final response, recorded with garbage outputs
         "response_outputs": [response(1), response(2), response(3), response(4, "length"), response(731732818)]},
        {"timestamp": 500 * ms, "request_inputs": {"max_tokens": 4, "ignore_eos": True},
         "response_timestamps": [530 * ms, 533 * ms, 536 * ms, 539 * ms],
         "response_outputs": [response(1), response(2), response(3), response(4, "length")]},
        {"timestamp": 600 * ms, "request_inputs": {"max_tokens": 4, "ignore_eos": True},  # cut short: an error
         "response_timestamps": [620 * ms, 640 * ms], "response_outputs": [response(1), response(2)]},
    ]}]}
    ((mode, value, requests),) = profile_export.experiments(export)
    assert (mode, value) == ("rate", 2.0)
    assert [r.complete for r in requests] == [True, True, False] and requests[0].tokens == 4
    row = profile_export.summarise(requests, asked=5)  # 5 asked for, 3 recorded, 2 complete
    assert row["n"] == 2 and row["errors"] == 3 and row["sent"] == 3
    assert row["ttft_ms_p50"] == pytest.approx(20.0)  # TTFTs 10 and 30 ms
    assert row["tpot_ms_p50"] == pytest.approx(3.0)  # (19 - 10) / 3 and (539 - 530) / 3
    assert row["itl_ms_p50"] == pytest.approx(3.0)  # gaps 2, 2, 5, 3, 3, 3
    assert row["itl_ms_p99"] == pytest.approx(np.percentile([2, 2, 5, 3, 3, 3], 99), abs=1e-3)
    assert row["out_tok_s"] == pytest.approx(8 / 0.539, abs=1e-3) and row["output_tokens"] == 8
    assert row["e2e_ms_p50"] == pytest.approx((19 + 39) / 2)
    # at a rate perf_analyzer may send more than asked: the first ones by send time are the run
    first_two = profile_export.summarise(requests, asked=2)
    assert (first_two["n"], first_two["errors"], first_two["sent"]) == (2, 0, 3)


def test_export_with_raw_image_bytes_loads(tmp_path):
    """perf_analyzer writes BYTES inputs as raw bytes inside JSON strings (not UTF-8)."""
    path = tmp_path / "export.json"
    path.write_bytes(b'{"experiments": [], "images": "\xff\xd8\x00abc", "version": "2.51.0"}')
    assert profile_export.load(path)["version"] == "2.51.0"


# -- the runner -------------------------------------------------------------------------------------

def test_perf_analyzer_arguments_per_mode(tmp_path):
    data = tmp_path / "in.json"
    at_c = run.perf_analyzer_args(run.Run("mm_qa", "text", data, "concurrency", 4, 40), "h:1", tmp_path / "e.json",
                                  "poisson")
    assert at_c[:6] == ["-m", "mm_qa", "-i", "grpc", "-u", "h:1"] and "--streaming" in at_c
    assert at_c[at_c.index("--concurrency-range") + 1] == "4" and at_c[at_c.index("--request-count") + 1] == "40"
    assert "--request-rate-range" not in at_c and at_c[-2:] == ["--profile-export-file", str(tmp_path / "e.json")]
    at_r = run.perf_analyzer_args(run.Run("mm_qa_bls", "business", data, "rate", 2.5, 1000), "h:1", None, "constant")
    assert at_r[at_r.index("--request-rate-range") + 1] == "2.5" and "--concurrency-range" not in at_r
    assert at_r[at_r.index("--request-distribution") + 1] == "constant" and "--profile-export-file" not in at_r


def test_default_request_counts_and_refused_arguments():
    args = run.parse_args(["--sweep", "--rate", "3", "--workload", "text"])
    runs = run.plan(args)
    assert [(r.mode, r.value, r.requests) for r in runs] == [
        ("concurrency", 1, 32), ("concurrency", 4, 32), ("concurrency", 16, 128), ("concurrency", 64, 512),
        ("rate", 3.0, 1000)]
    for bad in (["--rate", "0"], ["--workload", "text"], ["--rate", "1", "--model", "nope"],
                ["--rate", "1", "--append"]):
        with pytest.raises(SystemExit):
            run.parse_args(bad)


@pytest.fixture(scope="module")
def perf_analyzer():
    """The binary with its libraries; where they cannot be fetched (a machine without network, e.g.
    the lent GPU machine without the carried folder) the runner's tests skip, except in CI."""
    try:
        return deps.ensure()
    except Exception as e:  # noqa: BLE001 -- reported as the skip's reason
        if os.environ.get("CI"):
            raise
        pytest.skip(f"perf_analyzer's libraries unavailable: {e}")


def test_deps_resolve_every_library(perf_analyzer):
    binary, env = perf_analyzer
    assert deps.missing_libraries(binary, env) == []
    assert deps.version(binary, env) == "2.51.0"


def urls(server) -> list[str]:
    return ["--url", server.url_grpc, "--metrics-url", server.url_metrics]


@pytest.mark.integration
def test_runs_at_a_concurrency_and_a_rate_on_both_models(perf_analyzer, zipmoe_server, tmp_path, capsys):
    out, work = tmp_path / "load", tmp_path / "runs"
    argv = urls(zipmoe_server) + ["--model", "mm_qa,mm_qa_bls", "--workload", "business", "--concurrency", "2",
                                  "--rate", "4", "--requests", "6", "--warmup", "1", "--work-dir", str(work),
                                  "--out", str(out)]
    assert run.main(argv) == 0
    result = json.loads((tmp_path / "load.json").read_text())
    assert {"device", "checkpoint", "rows", "perf_analyzer", "distribution"} <= set(result)
    assert result["perf_analyzer"] == "2.51.0" and result["inputs"] == "ci"
    assert (tmp_path / "load.png").exists() == (importlib.util.find_spec("matplotlib") is not None)
    rows = result["rows"]
    assert [(r["model"], r["mode"], r["value"]) for r in rows] == [
        ("mm_qa", "concurrency", 2), ("mm_qa", "rate", 4.0), ("mm_qa_bls", "concurrency", 2), ("mm_qa_bls", "rate", 4.0)]
    for r in rows:
        assert ROW_KEYS <= set(r), r
        assert r["workload"] == "business" and r["routing"] == "topk" and r["n"] == 6 and r["errors"] == 0, r
        assert positive(*(r[k] for k in MEASURED), r["experts_read"]), r
        assert r["ttft_ms_p99"] >= r["ttft_ms_p50"] and r["preemptions"] == 0
        assert 0 <= r["steps_pipelined"] < 1  # async scheduling on; each request's prefill is a step of its own
        assert Path(r["export"]).parent == work and Path(r["export"]).exists()  # perf_analyzer's profile export
    printed = capsys.readouterr().out
    assert "business mm_qa topk: at most" in printed and "--rate" in printed

    # --append: a new row joins, a row measured again replaces its old self
    again = urls(zipmoe_server) + ["--workload", "text", "--concurrency", "2", "--requests", "4", "--warmup", "0",
                                   "--work-dir", str(work), "--out", str(out), "--append"]
    assert run.main(again) == 0 and run.main(again) == 0
    rows = json.loads((tmp_path / "load.json").read_text())["rows"]
    assert len(rows) == 5 and (rows[-1]["workload"], rows[-1]["n"]) == ("text", 4)


@pytest.mark.integration
def test_sere_rows_compare_with_topk_at_the_same_rate(perf_analyzer, zipmoe_server, sere_server, tmp_path, capsys):
    """The H200 workflow in small: one server per routing, rows appended into one JSON, the report
    sets each routing against topk at the same rate."""
    out = tmp_path / "load"
    common = ["--workload", "text", "--rate", "6", "--requests", "8", "--warmup", "1", "--work-dir",
              str(tmp_path / "runs"), "--out", str(out), "--append"]
    assert run.main(urls(zipmoe_server) + common) == 0
    assert run.main(urls(sere_server) + common + ["--routing", "sere"]) == 0
    rows = json.loads((tmp_path / "load.json").read_text())["rows"]
    assert [(r["routing"], r["errors"]) for r in rows] == [("topk", 0), ("sere", 0)]
    assert rows[1]["experts_read"] < rows[0]["experts_read"]  # rho 0 on the tiny model always moves slots
    capsys.readouterr()
    assert report.main([str(tmp_path / "load.json"), "--out", str(tmp_path / "again")]) == 0
    assert "text mm_qa sere at 6 req/s vs topk: TPOT p50" in capsys.readouterr().out


def test_a_routing_variant_is_read_against_topk_with_the_same_variant():
    """"sere sync" against "topk sync", "topk sync" against topk; a row without its baseline is skipped."""
    row = dict(workload="business", model="mm_qa", mode="rate", value=2.0, errors=0, ttft_ms_p50=100.0)
    rows = [{**row, "routing": "topk", "tpot_ms_p50": 10.0}, {**row, "routing": "topk sync", "tpot_ms_p50": 8.0},
            {**row, "routing": "sere sync", "tpot_ms_p50": 6.0}, {**row, "routing": "oea sync", "value": 3.0,
                                                                   "tpot_ms_p50": 5.0}]
    assert [report.baseline(r) for r in ("topk", "sere", "topk sync", "sere sync")] == \
        ["topk", "topk", "topk", "topk sync"]
    lines = report.against_topk(rows)
    assert len(lines) == 2
    assert lines[0].startswith("business mm_qa topk sync at 2 req/s vs topk: TPOT p50 -20.0 %")
    assert lines[1].startswith("business mm_qa sere sync at 2 req/s vs topk sync: TPOT p50 -25.0 %")


@pytest.mark.integration
def test_a_refused_request_gives_a_row_of_errors(perf_analyzer, zipmoe_server, tmp_path):
    """perf_analyzer stops at the first failed request: the row says so, with the server's reason."""
    bad = make_inputs.write({"data": [make_inputs.request("Tell me a story.", [], 100000)]}, tmp_path / "refused.json")
    argv = urls(zipmoe_server) + ["--workload", str(bad), "--concurrency", "1", "--requests", "3", "--warmup", "0",
                                  "--work-dir", str(tmp_path / "runs"), "--out", str(tmp_path / "bad")]
    assert run.main(argv) == 0
    (row,) = json.loads((tmp_path / "bad.json").read_text())["rows"]
    assert row["workload"] == "refused" and row["n"] == 0 and row["errors"] == 3 and row["ttft_ms_p50"] is None
    assert "max_tokens" in row["note"]
