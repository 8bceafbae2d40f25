"""Registers, spills and shared memory of the batch-1 decode step's Triton kernels, compiled for a
Hopper GPU (sm_90) on any machine, a GPU or none: what a kernel change does to them, read before
a GPU run.

    python -m zipmoe.kernels.benchmarks.sass_report [--patch dependent_launch.load_ahead=0.0]
        [--device-name "NVIDIA H100 80GB HBM3"] [--out report.json]

Each kernel is launched once as the engine launches it at Qwen3-30B-A3B's shape (the config of
`zipmoe.serve.REAL_SHAPE_CHECKPOINT`; the ops called with CPU tensors that are never read), its
kernel object swapped for one that records the launch (`_Recorder`). Triton's own launch binder
then gives the signature and specialisation a GPU launch would get (16-byte-aligned pointers and
multiples of 16 marked so, PDL on), and Triton compiles it for sm_90 with the ptxas its wheel
ships; `cuobjdump` reads the registers, stack (spills) and local loads and stores back. The expert
GEMMs take the tuned tile shapes of --device-name (`fused_moe_configs.json`). A kernel that spills
is slower than its loads say: the 128-key attention tile loaded ahead of its wait spills (191
local loads and stores) and was measured slower (docs/PERFORMANCE.md, session 38), the 64-key one
does not. The code's length counts too: ranking 128 experts against each other, Triton unrolled
about 1,700 instructions a thread ahead of the gate/up GEMM's first weight load, and its
replacement took that to 270 (docs/PERFORMANCE.md, session 45); and so do the programs that fit a
multiprocessor at once ("per SM"). Beside them: the launch's programs at this shape and the rounds
they take to be placed on 132 multiprocessors ("rounds", 1 where all fit at once). It also catches
what Triton's interpreter lets through, such as a name that both branches of a runtime `if` assign
at different shapes.

The output projection is reported as a Hopper GPU launches it: in Gluon (`out_proj_smem`, compiled
from Gluon's IR); with --patch folded_router.OUT_PROJ_SMEM=false, the Triton kernel.

The kernels run in Triton's interpreter on machines without CUDA (`zipmoe/kernels/__init__.py`), so
this module runs itself again with the interpreter off when it finds it on.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import math
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from unittest import mock

import torch

from zipmoe.checkpoint import TextConfig
from zipmoe.serve import REAL_SHAPE_CHECKPOINT

BLOCK, CONTEXT_BLOCKS = 16, 256  # a 4,096-token table
TARGET_ARCH = 90
# A Hopper multiprocessor's limits (CUDA's occupancy rules for sm_90): registers are given a warp at a
# time in units of 256; each block also takes 1 kB of the shared memory for the system.
SM_REGISTERS, SM_SHARED_BYTES, SM_WARPS, SM_BLOCKS, BLOCK_RESERVED_SHARED = 65536, 233472, 64, 32, 1024
MULTIPROCESSORS = 132  # the H100 SXM's and the H200's


class _Recorder:
    """Stands in for a kernel: `kernel[grid](*args, **kwargs)` records the launch and runs nothing."""

    def __init__(self, name: str, fn, launches: list):
        self.name, self.fn, self.launches = name, fn, launches

    def __getitem__(self, grid: tuple):
        def record(*args, **kwargs):
            if "PDL" in kwargs:
                kwargs.update(PDL=True, launch_pdl=True)  # as on a Hopper GPU
            self.launches.append((self.name, self.fn, math.prod(grid), args, kwargs))
        return record


def _step_launches() -> list:
    """(name, kernel, programs, args, kwargs) of each kernel of a batch-1 decode layer, as the ops launch them."""
    from zipmoe.kernels import folded_router, fused_moe, paged_attention, qkv_norm_rope
    launches: list = []
    kernels = [(qkv_norm_rope, "_qkv_norm_rope_kernel"), (paged_attention, "_partition_kernel"),
               (folded_router, "_out_proj_logits_kernel"), (folded_router, "out_proj_logits_smem_kernel"),
               (folded_router, "_routed_gate_up_kernel"),
               (fused_moe, "_down_kernel")]
    cfg = TextConfig.from_dir(REAL_SHAPE_CHECKPOINT)  # Qwen3-VL-30B-A3B's text decoder
    H, HQ, HKV, D, E, TOP_K = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.num_experts, cfg.top_k
    A, I = HQ * D, cfg.moe_intermediate_size
    with contextlib.ExitStack() as recorded:
        for module, name in kernels:
            recorded.enter_context(mock.patch.object(module, name, _Recorder(name, getattr(module, name), launches)))
        recorded.enter_context(mock.patch.object(folded_router, "hopper_or_later", lambda device: True))  # as on sm_90
        bf16 = dict(dtype=torch.bfloat16)
        slots = CONTEXT_BLOCKS * BLOCK
        k_cache, v_cache = (torch.empty(slots, HKV, D, **bf16) for _ in range(2))
        h, delta = torch.empty(1, H, **bf16), torch.empty(1, TOP_K, H, **bf16)
        cos, sin = torch.empty(1, D, **bf16), torch.empty(1, D, **bf16)
        qkv_norm_rope.fused_add_norm_qkv(h, delta, torch.empty(H, **bf16), torch.empty((HQ + 2 * HKV) * D, H, **bf16),
                                         torch.empty(D, **bf16), torch.empty(D, **bf16), cos, sin, k_cache, v_cache,
                                         torch.zeros(1, dtype=torch.int64), 1e-6, HQ, HKV)
        tables = torch.arange(CONTEXT_BLOCKS, dtype=torch.int32)[None]
        paged_attention.paged_decode_attention(torch.empty(1, HQ, D, **bf16), k_cache, v_cache, tables,
                                               torch.tensor([256], dtype=torch.int32), BLOCK, D ** -0.5)
        folded_router.folded_moe(h, torch.empty(1, A, **bf16), torch.empty(H, A, **bf16), torch.empty(H, **bf16),
                                 torch.empty(E, H, **bf16), torch.empty(E, H, **bf16), torch.empty(E, A, **bf16),
                                 torch.empty(E, 2 * I, H, **bf16), torch.empty(E, I, H, **bf16), TOP_K, True, TOP_K,
                                 True, None, 1e-6)
    return launches


def _cuobjdump() -> Path:
    import triton
    return Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"


def compile_for_hopper(fn, args: tuple, kwargs: dict):
    """Triton's compile of fn for sm_90 with the signature and specialisation its launch binder gives
    these arguments on a GPU."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile, make_backend
    from triton.experimental.gluon._runtime import GluonASTSource, GluonJITFunction
    from triton.runtime.jit import create_function_from_signature
    target = GPUTarget("cuda", TARGET_ARCH, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
    source = GluonASTSource if isinstance(fn, GluonJITFunction) else ASTSource
    return compile(source(fn, signature, constexprs, attrs), target=target, options=options.__dict__)


def resources(compiled) -> dict:
    """Registers a thread, stack bytes (spills), local loads and stores, shared memory bytes, and the
    code's length in SASS instructions."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        usage, sass = (subprocess.run([_cuobjdump(), flag, cubin.name], capture_output=True, text=True,
                                      check=True).stdout for flag in ("-res-usage", "-sass"))
    field = {k: int(v) for k, v in re.findall(r"(REG|STACK):(\d+)", usage)}
    return {"registers": field["REG"], "stack_bytes": field["STACK"],
            "local_ops": len(re.findall(r"\b(?:LDL|STL)\b", sass)), "shared_bytes": compiled.metadata.shared,
            "instructions": len(re.findall(r"^\s*/\*[0-9a-f]{4,}\*/", sass, re.MULTILINE))}


def programs_a_multiprocessor(registers: int, warps: int, shared_bytes: int) -> int:
    """How many of a launch's programs fit on one multiprocessor at once: the fewest its registers,
    shared memory and warps allow. Fewer registers and less shared memory are not always better: a
    launch placed while the one before still holds most multiprocessors stacks its programs on the
    few with room, up to this many (docs/PERFORMANCE.md, sessions 43 and 45)."""
    warp_registers = -(-registers * 32 // 256) * 256
    return min(SM_REGISTERS // (warp_registers * warps), SM_SHARED_BYTES // (shared_bytes + BLOCK_RESERVED_SHARED),
               SM_WARPS // warps, SM_BLOCKS)


def report(patches: list[str], device_name: str) -> list[dict]:
    """One row a kernel of the batch-1 layer, with `patches` ("module.NAME=json value") applied
    while the kernels are launched, and the expert GEMMs at device_name's tuned tiles."""
    from zipmoe.kernels import fused_moe
    settings = [(fused_moe, "config_key", lambda e, h, i: f"{device_name},E={e},H={h},I={i}")]
    for patch in patches:
        target, value = patch.split("=", 1)
        module, name = target.rsplit(".", 1)
        obj = importlib.import_module(f"zipmoe.kernels.{module}")
        if not hasattr(obj, name):
            raise ValueError(f"--patch {patch}: zipmoe.kernels.{module} has no {name}")
        settings.append((obj, name, json.loads(value)))
    with contextlib.ExitStack() as patched:
        for obj, name, value in settings:
            patched.enter_context(mock.patch.object(obj, name, value))
        launches = _step_launches()
    rows = [{"kernel": name, "num_warps": kwargs.get("num_warps", 4), "num_stages": kwargs.get("num_stages", 3),
             "programs": programs, **resources(compile_for_hopper(fn, args, kwargs))}
            for name, fn, programs, args, kwargs in launches]
    for r in rows:
        r["per_multiprocessor"] = programs_a_multiprocessor(r["registers"], r["num_warps"], r["shared_bytes"])
        r["rounds"] = math.ceil(r["programs"] / (r["per_multiprocessor"] * MULTIPROCESSORS))
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--patch", action="append", default=[], help="module.NAME=json value, e.g. "
                        "dependent_launch.load_ahead=0.0 (a module of zipmoe.kernels, a name it has)")
    parser.add_argument("--device-name", default="NVIDIA H100 80GB HBM3",
                        help="whose tuned expert tiles to take (a key of fused_moe_configs.json)")
    parser.add_argument("--out", type=Path, help="also write the rows as JSON here")
    args = parser.parse_args(argv)
    rows = report(args.patch, args.device_name)
    print(f"{'kernel':27} {'warps':>5} {'stages':>6} {'regs':>5} {'stack B':>8} {'local ops':>9} {'shared B':>9} "
          f"{'instrs':>7} {'per SM':>6} {'programs':>8} {'rounds':>6}")
    for r in rows:
        print(f"{r['kernel']:27} {r['num_warps']:>5} {r['num_stages']:>6} {r['registers']:>5} {r['stack_bytes']:>8} "
              f"{r['local_ops']:>9} {r['shared_bytes']:>9} {r['instructions']:>7} {r['per_multiprocessor']:>6} "
              f"{r['programs']:>8} {r['rounds']:>6}")
    if args.out:
        args.out.write_text(json.dumps({"arch": f"sm_{TARGET_ARCH}", "patches": args.patch, "rows": rows}, indent=1))


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") == "1":  # set by zipmoe.kernels on a machine without CUDA
        os.execve(sys.executable, [sys.executable, "-m", "zipmoe.kernels.benchmarks.sass_report", *sys.argv[1:]],
                  {**os.environ, "TRITON_INTERPRET": "0"})
    main()
