"""How long after a launch's last program ends the next launch's programs go on (issue 15 item 2):
a plain launch, programmatic dependent launch's wait (`kernels/dependent_launch.py`), and a counter
the next launch's programs spin on (what merging two launches into one would pay instead).

    python -m zipmoe.kernels.benchmarks.bench_pdl_release --out docs/results/pdl_release_h100

Two kernels back to back: the first's programs spin for 200 us on %globaltimer and store when they
end; the second's programs store when they are resident and again when they may go on (after
`griddepcontrol.wait`, after seeing every first program's release increment of a counter, or, a
plain launch, at once). Per grid shape and mode it reports, as medians over the repetitions, the
time from the first launch's last end to the second launch's first and median go, and how long
before that end its programs were resident. %globaltimer ticks in steps of a few hundred ns on
some GPUs: read the figures to that step. Writes OUT.json and OUT.png.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from zipmoe.plotting import pyplot, write_plot

from .timing import require_cuda

import triton  # after zipmoe.kernels (the package) chose the interpreter on CPU-only machines
import triton.language as tl
from triton.language.extra import cuda as tc

SHAPES = ((132, 132), (528, 264), (264, 512))  # (first, second) programs: one a multiprocessor, more
MODES = ("plain", "pdl", "counter")
SPIN_NS = 200_000  # longer than the host takes to launch the second kernel (Triton: tens of us)


@triton.jit
def _first(times_ptr, counter_ptr, spin_ns, PDL: tl.constexpr, COUNTER: tl.constexpr):
    if PDL:
        tc.gdc_wait()
        tc.gdc_launch_dependents()
    t0 = tc.globaltimer()
    t = t0
    while t - t0 < spin_ns:
        t = tc.globaltimer()
    if COUNTER:
        tl.debug_barrier()
        tl.atomic_add(counter_ptr, 1, sem="release")
    tl.store(times_ptr + tl.program_id(0), tc.globaltimer())


@triton.jit
def _second(times_ptr, counter_ptr, first_programs, PDL: tl.constexpr, COUNTER: tl.constexpr):
    # The probe's own stores before the wait touch nothing the first launch reads or writes.
    pid = tl.program_id(0)
    tl.store(times_ptr + 2 * pid, tc.globaltimer())
    if COUNTER:
        seen = tl.atomic_add(counter_ptr, 0, sem="acquire")
        while seen < first_programs:
            seen = tl.atomic_add(counter_ptr, 0, sem="acquire")
        tc.gdc_launch_dependents()
    elif PDL:
        tc.gdc_wait()
        tc.gdc_launch_dependents()
    tl.store(times_ptr + 2 * pid + 1, tc.globaltimer())


def warm_up(seconds: float = 1.0) -> None:
    """Keeps the GPU busy a while first: an idle one starts at low clocks, and its launches then
    took 4-5 times as long (H100, session 43)."""
    x = torch.randn(4096, 4096, device="cuda")
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        for _ in range(20):
            x = (x @ x).clamp_(-1, 1)
        torch.cuda.synchronize()


def measure(first: int, second: int, mode: str, reps: int = 100) -> dict:
    """Medians over `reps` pairs of launches (ns); the counter mode launches the second with PDL,
    so that it starts while the first runs, and never waits on the grid."""
    pdl, counter = mode != "plain", mode == "counter"
    first_times = torch.zeros(first, dtype=torch.int64, device="cuda")
    second_times = torch.zeros(2 * second, dtype=torch.int64, device="cuda")
    count = torch.zeros(1, dtype=torch.int32, device="cuda")
    first_go, median_go, resident = [], [], []
    for _ in range(reps):
        count.zero_()
        torch.cuda.synchronize()
        _first[(first,)](first_times, count, SPIN_NS, PDL=pdl, COUNTER=counter, num_warps=4, launch_pdl=pdl)
        _second[(second,)](second_times, count, first, PDL=pdl, COUNTER=counter, num_warps=4, launch_pdl=pdl)
        torch.cuda.synchronize()
        end = first_times.max().item()
        go = second_times[1::2].double() - end  # int64 ns since an epoch: float32 would round them away
        first_go.append(go.min().item())
        median_go.append(go.median().item())
        resident.append(end - second_times[0::2].double().min().item())
    return {"first_programs": first, "second_programs": second, "mode": mode,
            "first_go_ns": statistics.median(first_go), "median_go_ns": statistics.median(median_go),
            "resident_before_end_ns": statistics.median(resident)}


def plot(result: dict, out: Path) -> bool:
    """Median go after the first launch's end, per shape and mode; False without matplotlib."""
    plt = pyplot()
    if plt is None or not result["rows"]:
        return False
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(MODES)
    for i, mode in enumerate(MODES):
        rows = [r for r in result["rows"] if r["mode"] == mode]
        ax.bar([j + i * width for j in range(len(rows))], [r["median_go_ns"] / 1e3 for r in rows], width, label=mode)
    ax.set_xticks([j + width for j in range(len(SHAPES))], [f"{a} then {b} programs" for a, b in SHAPES])
    ax.set(ylabel="us from the last end to the median go", title=f"launch to launch, {result['device']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return True


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="docs/results/pdl_release_h200")
    args = ap.parse_args(argv)
    require_cuda(ap)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {"device": torch.cuda.get_device_name(), "spin_ns": SPIN_NS, "rows": []}
    for first, second in SHAPES:
        for mode in MODES:
            warm_up(0.5)
            result["rows"].append(measure(first, second, mode))
            print(result["rows"][-1], flush=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    write_plot(result, out.with_suffix(".png"), plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
