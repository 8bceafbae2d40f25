"""The PNGs that benchmarks and reports draw beside their JSON (`zipmoe.kernels.benchmarks`,
`zipmoe.clients`, `perf_analyzer_configs/report.py`): matplotlib off-screen, and optional. It comes
with the `bench` extra (`pip install -e '.[bench]'`); without it the JSON, which is the result, is
still written and the run says that no plot was drawn, instead of failing after the measurement."""
from __future__ import annotations

from pathlib import Path
from typing import Callable


def pyplot():
    """matplotlib.pyplot drawing off-screen (Agg), or None where matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def write_plot(result: dict, path: Path, plotter: Callable[[dict, Path], bool]) -> None:
    """plotter(result, path), which returns whether it drew (False also where result has nothing it
    draws), saying what became of it."""
    if pyplot() is None:
        print("matplotlib not importable (pip install -e '.[bench]'): no plot")
    elif plotter(result, path):
        print(f"wrote {path}")
