"""`sass_report` compiles the batch-1 layer's kernels for sm_90 on a machine without a GPU: every
kernel the layer launches, with the resources cuobjdump reads back, and a patch applied."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

KERNELS = {"_qkv_norm_rope_kernel", "_partition_kernel", "out_proj_logits_smem_kernel", "_routed_gate_up_kernel"}
TRITON_OUT_PROJ = KERNELS - {"out_proj_logits_smem_kernel"} | {"_out_proj_logits_kernel"}


def _report(tmp_path, *args: str) -> dict:
    out = tmp_path / "report.json"
    env = {**os.environ, "TRITON_INTERPRET": "1"}  # as on a CPU-only machine: the module turns it off itself
    subprocess.run([sys.executable, "-m", "zipmoe.kernels.benchmarks.sass_report", "--out", str(out), *args],
                   check=True, env=env, capture_output=True, text=True, timeout=600)
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def committed(tmp_path_factory) -> dict:
    """The report of the kernels as committed (compiled once for the tests that read it)."""
    return _report(tmp_path_factory.mktemp("committed"))


def test_every_kernel_of_the_batch_1_layer_compiles_for_sm_90(committed):
    assert committed["arch"] == "sm_90"
    assert {r["kernel"] for r in committed["rows"]} == KERNELS
    for r in committed["rows"]:
        assert 16 <= r["registers"] <= 255 and r["stack_bytes"] >= 0 and r["local_ops"] >= 0 and r["shared_bytes"] > 0
        assert r["instructions"] > 100  # a kernel's code, counted from its SASS listing


def test_a_patch_changes_the_kernel_it_reaches(tmp_path, committed):
    """The down GEMM as its own launch (`folded_router.FUSED_DOWN` off): the layer launches it too, the
    gate/up kernel is shorter, and the q/k/v kernel, which the knob does not reach, compiles as before
    (the output projection is then the Triton kernel's: the Gluon one zeroes the fused slots)."""
    fused = {r["kernel"]: r for r in committed["rows"]}
    apart = {r["kernel"]: r for r in _report(tmp_path, "--patch", "folded_router.FUSED_DOWN=false")["rows"]}
    assert set(apart) == TRITON_OUT_PROJ | {"_down_kernel"}
    assert apart["_routed_gate_up_kernel"]["instructions"] < fused["_routed_gate_up_kernel"]["instructions"]
    assert apart["_qkv_norm_rope_kernel"] == fused["_qkv_norm_rope_kernel"]


def test_the_fold_gate_up_programs_sit_two_a_multiprocessor(tmp_path, committed):
    """Its K tile of 256 (80 kB of shared memory) keeps the launch at two programs a multiprocessor;
    at the tuned 128 five would fit, and the step was slower (docs/PERFORMANCE.md, session 45)."""
    per_sm = {r["kernel"]: r["per_multiprocessor"] for r in committed["rows"]}
    assert per_sm["_routed_gate_up_kernel"] == 2 and all(n >= 1 for n in per_sm.values())
    tuned = _report(tmp_path, "--patch", "folded_router.FOLD_GATE_UP_BLOCK_K=0")
    assert {r["kernel"]: r["per_multiprocessor"] for r in tuned["rows"]}["_routed_gate_up_kernel"] == 5


def test_the_output_projection_compiles_in_gluon_or_in_triton(tmp_path, committed):
    """As a Hopper GPU launches it: the Gluon launch, each program's 4 rows x 4,096 columns (32 kB) in
    shared memory; with OUT_PROJ_SMEM off, the Triton kernel, its rows in registers."""
    gluon = {r["kernel"]: r for r in committed["rows"]}["out_proj_logits_smem_kernel"]
    assert gluon["shared_bytes"] >= 4 * 4096 * 2 and gluon["stack_bytes"] == 0
    triton_rows = _report(tmp_path, "--patch", "folded_router.OUT_PROJ_SMEM=false")["rows"]
    assert {r["kernel"] for r in triton_rows} == TRITON_OUT_PROJ


def test_programs_a_multiprocessor_takes_the_tightest_limit():
    from zipmoe.kernels.benchmarks.sass_report import programs_a_multiprocessor
    assert programs_a_multiprocessor(255, 4, 40960) == 2  # registers: 256 a thread, 32 k a program
    assert programs_a_multiprocessor(64, 4, 40960) == 5  # shared memory: 41 kB of 228
    assert programs_a_multiprocessor(32, 8, 0) == 8  # warps: 64 a multiprocessor
    assert programs_a_multiprocessor(16, 1, 0) == 32  # programs: 32 a multiprocessor


def test_a_patch_of_a_name_the_module_lacks_is_refused():
    """A misspelt knob would otherwise be set as a new attribute and change nothing."""
    run = subprocess.run([sys.executable, "-m", "zipmoe.kernels.benchmarks.sass_report", "--patch",
                          "paged_attention.NO_SUCH_KNOB=1"], env={**os.environ, "TRITON_INTERPRET": "0"},
                         capture_output=True, text=True, timeout=600)
    assert run.returncode != 0 and "zipmoe.kernels.paged_attention has no NO_SUCH_KNOB" in run.stderr


def test_every_kernel_of_the_batch_1_layer_is_placed_in_one_round(committed):
    """At the 30B shape each launch's programs all fit the 132 multiprocessors at once; with the
    gate/up's routing program in a grid row of its own (288 programs for 264 places) 24 GEMM programs
    waited for a second placement (docs/PERFORMANCE.md, session 47)."""
    from zipmoe.checkpoint import TextConfig
    from zipmoe.kernels.folded_router import FOLD_COLUMNS
    from zipmoe.serve import REAL_SHAPE_CHECKPOINT
    for r in committed["rows"]:
        assert r["programs"] >= 1 and r["rounds"] == 1, r
    cfg = TextConfig.from_dir(REAL_SHAPE_CHECKPOINT)
    gate_up = {r["kernel"]: r for r in committed["rows"]}["_routed_gate_up_kernel"]
    # the routing program, then K x I / FOLD_COLUMNS GEMM programs
    assert gate_up["programs"] == 1 + cfg.top_k * math.ceil(cfg.moe_intermediate_size / FOLD_COLUMNS)
