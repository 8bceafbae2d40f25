"""bench_serving end to end in a tiny configuration against the shared tiny-checkpoint server, and
bench_serving_report re-rendering a saved result.

Only the JSON's structure is checked, and that numbers are finite and positive: never timings."""
from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest

from zipmoe.clients import bench_common, bench_serving, bench_serving_report

SAVED = Path(__file__).resolve().parents[1] / "docs" / "results" / "serving_30b_h200.json"  # a real H200 run

ROW_KEYS = {"bench", "keep_ratio", "routing", "concurrency", "images", "n", "ttft_ms_p50", "ttft_ms_p90",
            "tpot_ms_p50", "tpot_ms_p90", "itl_ms_p99", "tokens_per_s", "images_per_s"}
TINY = ["--images", "2", "--image-size", "64x64", "--keep", "1.0,0.5", "--n", "2", "--warmup", "1",
        "--tpot-tokens", "8", "--streams", "2", "--stream-tokens", "16", "--duration", "3", "--period", "1",
        "--decode-images", "4", "--decode-size", "128x96"]


def positive(*values) -> bool:
    return all(isinstance(v, (int, float)) and math.isfinite(v) and v > 0 for v in values)


def urls(server) -> list[str]:
    return ["--url", server.url_grpc, "--http-url", server.url_http, "--metrics-url", server.url_metrics]


@pytest.mark.integration
def test_every_bench_against_a_running_server(zipmoe_server, tmp_path, capsys):
    out = tmp_path / "bench"
    assert bench_serving.main(urls(zipmoe_server) + TINY + ["--routing", "topk", "--out", str(out)]) == 0
    result = json.loads((tmp_path / "bench.json").read_text())
    assert (tmp_path / "bench.png").exists() == (importlib.util.find_spec("matplotlib") is not None)
    assert {"device", "copy_gbps", "checkpoint", "overrides", "rows"} <= set(result)
    assert result["copy_gbps"] is None if result["device"] == "cpu" else positive(result["copy_gbps"])
    rows = {}
    for r in result["rows"]:
        assert ROW_KEYS <= set(r), r
        assert "failed" not in (r.get("note") or ""), r
        rows.setdefault(r["bench"], []).append(r)
    assert sorted(rows) == sorted(bench_serving.BENCHES)
    assert [(r["image_size"], r["keep_ratio"]) for r in rows["ttft_30img"]] == [("64x64", 1.0), ("64x64", 0.5)]
    for r in rows["ttft_30img"]:
        assert r["n"] == 2 and r["images"] == 2 and r["routing"] == "topk" and r["channel"] == "persistent"
        assert positive(r["ttft_ms_p50"], r["ttft_ms_p90"], r["visual_tokens"]) and r["ttft_ms_p90"] >= r["ttft_ms_p50"]
        assert r["tpot_ms_p50"] is None and r["images_per_s"] is None
        b = r["breakdown_ms"]
        assert {"image_decode", "vision_encoder", "vision_forward", "visionzip", "decoder_ttft"} <= set(b)
        assert positive(b["preprocess"], b["image_decode"], b["vision_encoder"], b["decoder_ttft"])
        assert all(b[k] is None or positive(b[k]) for k in ("vision_forward", "visionzip"))  # counters may be absent
    (decode,) = rows["image_decode"]
    assert decode["images"] == 4 and decode["n"] == 2
    assert positive(decode["images_per_s"], decode["client_images_per_s"], decode["compute_ms_per_request"])
    phases = decode["phases_ms"]  # image_decode's own counters; the rest of its compute time is the response
    assert list(phases) == ["input", "check", "pipeline", "output", "response"]
    assert positive(phases["pipeline"]) and all(v >= 0 for k, v in phases.items() if k != "response")
    assert sum(phases.values()) == pytest.approx(decode["compute_ms_per_request"], abs=0.01)
    (tpot,) = rows["tpot_c1"]
    assert tpot["tokens"] == 8 and tpot["n"] == 2
    assert positive(tpot["ttft_ms_p50"], tpot["tpot_ms_p50"], tpot["tpot_ms_p90"], tpot["itl_ms_p99"],
                    tpot["tokens_per_s"], tpot["server_tpot_ms"])
    (mixed,) = rows["mixed"]
    assert mixed["concurrency"] == 2 and mixed["failed"] == 0 and mixed["n"] == mixed["image_requests"] == 3
    assert positive(mixed["ttft_ms_p50"], mixed["ttft_ms_p90"], mixed["tpot_ms_p50"], mixed["itl_ms_p50"],
                    mixed["itl_ms_p99"], mixed["tokens_per_s"])
    assert len(mixed["itl_ms_quantiles"]) == 101
    assert mixed["gpu_turn_waits"] == 0  # exported; no turns on a CPU (gpu_turn_ms does nothing off a GPU)
    long_gaps = mixed["long_gaps"]
    assert long_gaps["threshold_ms"] == pytest.approx(2.5 * mixed["itl_ms_p50"], rel=0.01)
    assert sum(long_gaps["start_after_send_ms"].values()) <= long_gaps["long_gaps"]
    (text,) = rows["mixed_text"]  # the same load with text-only arrivals as long as the image request
    assert text["images"] == 0 and text["failed"] == 0 and text["n"] == text["image_requests"] == 3
    assert positive(text["ttft_ms_p50"], text["itl_ms_p50"], text["itl_ms_p99"], text["tokens_per_s"])
    printed = capsys.readouterr().out
    assert all(name in printed for name in bench_serving.BENCHES) and "wrote" in printed


@pytest.mark.integration
def test_starts_one_server_with_overrides_and_extra_args(zipmoe_server, tiny_checkpoint, tmp_path, monkeypatch):
    """Without --url: one TritonServer with the checkpoint, the --set overrides and the --extra-arg flags
    (stood in for by the session server, so no second tritonserver starts)."""
    made = []

    class Server:
        url_grpc, url_http, url_metrics = zipmoe_server.url_grpc, zipmoe_server.url_http, zipmoe_server.url_metrics

        def __init__(self, repository, **kwargs):
            made.append(kwargs)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            made.append("stopped")

        def wait_ready(self, timeout):
            made.append("ready")

    monkeypatch.setattr(bench_serving.serve, "TritonServer", Server)
    monkeypatch.setattr(bench_serving, "device_info", lambda: ("cpu", None))
    argv = ["--checkpoint", str(tiny_checkpoint), "--set", "moe_decoder.routing_policy=oea",
            "--extra-arg=--cuda-memory-pool-byte-size=0:1073741824", "--bench", "tpot_c1", "--tpot-tokens", "4",
            "--n", "1", "--warmup", "0", "--channel", "per-request", "--out", str(tmp_path / "own.json")]
    assert bench_serving.main(argv) == 0
    kwargs, *rest = made
    assert rest == ["ready", "stopped"]
    assert kwargs["checkpoint"] == str(tiny_checkpoint)
    assert kwargs["overrides"] == {"moe_decoder": {"routing_policy": "oea"}}
    assert kwargs["extra_args"] == ["--cuda-memory-pool-byte-size=0:1073741824"]
    assert len({kwargs["http_port"], kwargs["grpc_port"], kwargs["metrics_port"]}) == 3
    result = json.loads((tmp_path / "own.json").read_text())
    assert result["overrides"] == {"moe_decoder": {"routing_policy": "oea"}}
    assert result["extra_args"] == ["--cuda-memory-pool-byte-size=0:1073741824"]
    (row,) = result["rows"]
    assert row["bench"] == "tpot_c1" and row["routing"] == "oea" and positive(row["tpot_ms_p50"])
    assert row["channel"] == "per-request"


def test_synthetic_jpegs_are_seeded_and_detailed():
    a, b = bench_common.synthetic_jpeg(0, (256, 192)), bench_common.synthetic_jpeg(1, (256, 192))
    assert a == bench_common.synthetic_jpeg(0, (256, 192)) and a != b
    assert a[:2] == b"\xff\xd8" and len(a) > 256 * 192 * 3 // 20  # no flat test card: well above 5 % of raw


def test_bad_arguments_are_refused():
    with pytest.raises(SystemExit):
        bench_serving.parse_args(["--bench", "ttft_30img,nope"])
    with pytest.raises(SystemExit):
        bench_serving.parse_args(["--n", "0"])


def test_report_rerenders_a_saved_result(tmp_path, capsys):
    """Its extra keys (max_num_batched_tokens on mixed rows, engine_step_ms_topk) are ignored."""
    saved = SAVED.read_bytes()
    assert bench_serving_report.main([str(SAVED), "--out", str(tmp_path / "again")]) == 0
    printed = capsys.readouterr().out
    benches = {r["bench"] for r in json.loads(saved)["rows"]}  # the saved run predates mixed_text
    assert all(name in printed for name in benches) and "NVIDIA H200" in printed
    assert (tmp_path / "again.png").exists() == (importlib.util.find_spec("matplotlib") is not None)
    assert SAVED.read_bytes() == saved
