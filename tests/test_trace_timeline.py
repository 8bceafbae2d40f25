"""trace_timeline: Triton's trace turned into consecutive spans per request (unit, on a written
trace), and bench_serving --trace starting a traced server of its own (integration)."""
from __future__ import annotations

import json
import math

import pytest

from zipmoe.clients import bench_serving, trace_timeline

EVENTS = ("REQUEST_START", "QUEUE_START", "COMPUTE_START", "COMPUTE_INPUT_END", "COMPUTE_OUTPUT_START",
          "COMPUTE_END", "REQUEST_END")


def step(tid: int, model: str, parent: int | None, start: int) -> list[dict]:
    """Trace entries as Triton writes them: a header, then one entry per timestamp (ns; 1 ms apart)."""
    header = {"id": tid, "model_name": model, "model_version": 1}
    if parent is not None:
        header["parent_id"] = parent
    return [header] + [{"id": tid, "timestamps": [{"name": e, "ns": start + i * 1_000_000}]}
                       for i, e in enumerate(EVENTS)]


def write(path, entries) -> None:
    path.write_text(json.dumps(entries))


def ensemble_request(tid: int, start: int) -> list[dict]:
    """mm_qa with preprocess, then moe_decoder (decoupled) whose two responses each run postprocess."""
    return (step(tid, "mm_qa", None, start)
            + step(tid + 1, "preprocess", tid, start + 100_000)
            + step(tid + 2, "moe_decoder", tid, start + 7_000_000)
            + step(tid + 3, "postprocess", tid, start + 20_000_000)
            + step(tid + 4, "postprocess", tid, start + 30_000_000))


def test_spans_run_from_arrival_to_the_first_response_and_add_up(tmp_path):
    prefix = tmp_path / "t.json"
    write(tmp_path / "t.json.0", ensemble_request(10, 1_000_000_000))
    (req,) = trace_timeline.requests(trace_timeline.read(prefix))
    spans = trace_timeline.segments(req)
    assert list(spans)[:7] == ["arrival>preprocess", "preprocess.wait", "preprocess.input", "preprocess.execute",
                               "preprocess.output", "preprocess.release", "preprocess>moe_decoder"]
    assert spans["arrival>preprocess"] == 0.1 and spans["preprocess.wait"] == 2.0  # QUEUE_START lies inside wait
    assert spans["preprocess>moe_decoder"] == pytest.approx(0.9)  # preprocess ended at 6.1 ms
    assert spans["moe_decoder>postprocess"] == pytest.approx(7.0)  # the first response's step only
    assert sum(v for k, v in spans.items() if k != "total") == pytest.approx(spans["total"])
    assert spans["total"] == pytest.approx(26.0)  # to the end of the first postprocess


def test_requests_are_chosen_by_arrival_and_only_when_finished(tmp_path):
    prefix = tmp_path / "t.json"
    unfinished = ensemble_request(30, 3_000_000_000)
    unfinished = [e for e in unfinished if not (e["id"] == 31 and "timestamps" in e
                                                 and e["timestamps"][0]["name"] == "REQUEST_END")]
    write(tmp_path / "t.json.0", ensemble_request(10, 1_000_000_000) + ensemble_request(20, 2_000_000_000))
    write(tmp_path / "t.json.1", unfinished)
    (tmp_path / "t.json.2").write_text('[{"id": 40, "model_na')  # still being written: skipped
    traces = trace_timeline.read(prefix)
    assert len(trace_timeline.requests(traces)) == 2
    (late,) = trace_timeline.requests(traces, since_ns=1_500_000_000)
    assert late["ts"]["REQUEST_START"] == 2_000_000_000
    assert trace_timeline.requests(traces, "image_decode") == []


def test_a_model_called_directly_is_its_own_step(tmp_path):
    write(tmp_path / "t.json", step(5, "image_decode", None, 0))
    (req,) = trace_timeline.requests(trace_timeline.read(tmp_path / "t.json"), "image_decode")
    spans = trace_timeline.segments(req)
    assert spans["image_decode.execute"] == 1.0 and spans["total"] == 6.0


def test_medians_and_the_command_line(tmp_path, capsys):
    write(tmp_path / "t.json.0", ensemble_request(10, 0) + ensemble_request(20, 10**9) + ensemble_request(30, 2 * 10**9))
    reqs = trace_timeline.requests(trace_timeline.read(tmp_path / "t.json"))
    assert trace_timeline.median_segments(reqs)["total"] == 26.0
    assert trace_timeline.main([str(tmp_path / "t.json")]) == 0
    out = capsys.readouterr().out
    assert "3 mm_qa requests" in out and "moe_decoder>postprocess" in out
    assert trace_timeline.main([str(tmp_path / "none.json")]) == 1


@pytest.mark.integration
def test_bench_serving_traces_the_server_it_starts(tiny_checkpoint, tmp_path):
    """--trace without --url: the server starts with trace_timeline.server_args, and the ttft_30img and
    image_decode rows carry the medians of their own requests' spans."""
    prefix = tmp_path / "trace" / "t.json"
    argv = ["--checkpoint", str(tiny_checkpoint), "--bench", "ttft_30img,image_decode", "--images", "2",
            "--image-size", "64x64", "--keep", "1.0", "--n", "2", "--warmup", "1", "--decode-images", "2",
            "--decode-size", "128x96", "--trace", str(prefix), "--log-file", str(tmp_path / "server.log"),
            "--out", str(tmp_path / "bench")]
    assert bench_serving.main(argv) == 0
    ttft, decode = json.loads((tmp_path / "bench.json").read_text())["rows"]
    spans = ttft["timeline_ms"]
    for model in ("preprocess", "image_decode", "vision_encoder", "moe_decoder", "postprocess"):
        assert math.isfinite(spans[f"{model}.execute"]) and spans[f"{model}.execute"] >= 0
    assert spans["total"] > 0 and "image_decode>vision_encoder" in spans
    assert set(decode["timeline_ms"]) >= {"image_decode.input", "image_decode.execute", "total"}
    assert list(prefix.parent.glob("t.json.*"))
