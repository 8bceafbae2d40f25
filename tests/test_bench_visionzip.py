"""The vision-side replays on the CPU at a small size (no timing is asserted): bench_visionzip writes one
row per keep ratio and part and its features are what compress accepts; profile_vision writes its tables."""
from __future__ import annotations

import json

from zipmoe.kernels.benchmarks import bench_visionzip


def test_the_visionzip_bench_writes_its_rows(tmp_path):
    out = tmp_path / "visionzip"
    assert bench_visionzip.main(["--device", "cpu", "--images", "3", "--tokens", "16", "--reps", "1",
                                 "--out", str(out)]) == 0
    result = json.loads(out.with_suffix(".json").read_text())
    assert (result["images"], result["tokens_per_image"]) == (3, 16)
    parts = {"select_tokens", "compress", "compress + decoder_inputs"}
    assert {(r["keep_ratio"], r["part"]) for r in result["rows"]} == {(k, p) for k in (1.0, 0.6, 0.4) for p in parts}
    assert all(r["ms"] >= 0 for r in result["rows"])


def test_its_features_keep_the_budget():
    feats = bench_visionzip.make_features(4, 16, 32, 3, 8, "cpu")
    tokens = bench_visionzip.compress(feats, 0.5)
    assert sum(t.embeds.shape[0] for t in tokens) == 32  # round(0.5 * 64)
    assert all(t.deepstack.shape[0] == 3 and t.embeds.dtype.is_floating_point for t in tokens)


def test_the_vision_profile_writes_its_tables(tmp_path, tiny_checkpoint):
    """profile_vision on the CPU with the tiny tower: host operators only (no device kernels there)."""
    from zipmoe.kernels.benchmarks import profile_vision

    out = tmp_path / "vision"
    assert profile_vision.main(["--checkpoint", str(tiny_checkpoint), "--load-format", "auto", "--images", "2",
                                "--size", "64x64", "--reps", "1", "--out", str(out)]) == 0
    result = json.loads(out.with_suffix(".json").read_text())
    assert (result["images"], result["size"]) == (2, "64x64") and result["features_ms"] > 0
    assert result["host_ops"] and all(op["calls"] >= 1 for op in result["host_ops"])


def test_the_gpu_timeline_finds_the_idle_gaps():
    """gpu_timeline on made-up profiler events (microseconds): busy time merges overlapping kernels,
    gaps are named by the kernel that ends them, all relative to the features() call."""
    from types import SimpleNamespace as NS

    import torch

    from zipmoe.kernels.benchmarks.profile_vision import gpu_timeline

    cpu, cuda = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA
    event = lambda name, kind, start, end: NS(name=name, device_type=kind, time_range=NS(start=start, end=end))  # noqa: E731
    events = [event("features", cpu, 0, 10_000), event("features", cuda, 2_000, 9_000),  # the label's device range
              event("a", cuda, 2_000, 3_000), event("b", cuda, 2_500, 4_000),
              event("c", cuda, 7_000, 8_000), event("d", cuda, 8_500, 9_000)]
    t = gpu_timeline(events)
    assert (t["call_ms"], t["first_kernel_after_ms"], t["last_kernel_end_after_ms"]) == (10.0, 2.0, 9.0)
    assert (t["gpu_busy_ms"], t["gpu_idle_ms"]) == (3.5, 3.5)
    assert t["idle_gaps"] == [{"ms": 3.0, "before": "c"}, {"ms": 0.5, "before": "d"}]
