"""The benchmarks' and reports' optional PNGs (`zipmoe.plotting`) and the GPU benchmarks' refusal on
a machine without CUDA (`timing.require_cuda`): a clear message, never a traceback after the work."""
import importlib
import sys

import pytest
import torch

from zipmoe import plotting
from zipmoe.kernels.benchmarks import plots


def test_write_plot_without_matplotlib_says_so_and_draws_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    assert plotting.pyplot() is None
    calls = []
    plotting.write_plot({}, tmp_path / "x.png", lambda result, path: calls.append(path) or True)
    assert calls == []
    assert "matplotlib not importable" in capsys.readouterr().out


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="the bench extra is not installed")
def test_write_plot_says_wrote_only_when_the_plotter_drew(tmp_path, capsys):
    plotting.write_plot({"rows": []}, tmp_path / "none.png", plots.plot)  # no row it draws
    assert capsys.readouterr().out == "" and not (tmp_path / "none.png").exists()
    rows = [{"bench": "step_variant", "impl": "graph_replay", "batch": 1, "time_us": 3000.0, "policy": "as committed"}]
    plotting.write_plot({"rows": rows, "copy_gbps": 1.0, "device": "test"}, tmp_path / "one.png", plots.plot)
    assert "wrote" in capsys.readouterr().out and (tmp_path / "one.png").exists()


def test_each_knob_variant_is_read_against_its_own_sets_first_row_of_the_case():
    def knob(policy, context, us):
        return {"bench": "step_knob", "impl": "graph_replay", "batch": 1, "context": context, "time_us": us,
                "policy": policy}
    rows = [knob("a: committed", 256, 1000.0), knob("a: x", 256, 1100.0), knob("b: committed", 256, 2000.0),
            knob("b: y", 256, 1900.0), knob("b: y", 4096, 3000.0),
            {**knob("a: x", 256, 5.0), "impl": "engine_step"}]  # not a replay: not drawn
    cases, variants, change = plots.variant_changes(rows)
    assert cases == [(1, 256), (1, 4096)] and variants == ["a: committed", "a: x", "b: committed", "b: y"]
    assert change[("a: x", (1, 256))] == pytest.approx(10.0) and change[("b: y", (1, 256))] == pytest.approx(-5.0)
    assert change[("b: y", (1, 4096))] == 0.0  # the first of set b at that case
    assert change[("a: committed", (1, 256))] == 0.0 and ("a: x", (1, 4096)) not in change


def test_kernel_plots_draw_nothing_without_rows(tmp_path):
    assert plots.plot({"rows": []}, tmp_path / "none.png") is False
    assert not (tmp_path / "none.png").exists()


@pytest.mark.parametrize("name", ["bench_kernels", "profile_decode", "bench_expert_parallel", "bench_importance",
                                  "bench_paged_attention", "bench_pdl_release"])
def test_gpu_benchmarks_stop_with_a_reason_without_cuda(name, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    bench = importlib.import_module(f"zipmoe.kernels.benchmarks.{name}")
    with pytest.raises(SystemExit) as stopped:
        bench.main([])
    assert stopped.value.code == 2
    assert "CUDA GPU" in capsys.readouterr().err


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="the bench extra is not installed")
def test_the_launch_to_launch_plot_draws_a_bar_per_shape_and_mode(tmp_path):
    from zipmoe.kernels.benchmarks import bench_pdl_release as probe
    rows = [{"first_programs": a, "second_programs": b, "mode": mode, "median_go_ns": 800.0}
            for a, b in probe.SHAPES for mode in probe.MODES]
    assert probe.plot({"rows": rows, "device": "test"}, tmp_path / "go.png") and (tmp_path / "go.png").exists()
    assert probe.plot({"rows": [], "device": "test"}, tmp_path / "none.png") is False
