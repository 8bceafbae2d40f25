"""Kernels and the decode step at Qwen3-30B-A3B's shape on random weights (H200).

    python -m zipmoe.kernels.benchmarks.bench_kernels --out docs/results/kernels_h200
        [--parts decode,prefill,moe,sere,router,qkv,one_token,step_knobs,importance,paged] [--sweep]

Every time is read against the device-copy bandwidth measured in the same run. Parts:
- moe (and --sweep): one MoE layer, its align step and its tile shapes: kernels/benchmarks/bench_moe.py.
- sere: the re-route kernel per layer-step, as the engine launches it and in other launch shapes,
  vs the reference's device ops (all in a graph).
- router: the router's GEMM and top-K in one launch (`router.fused_router`) vs cuBLAS's GEMM
  then `topk_softmax`, 48 layers' gates in a graph, per layer. `router.router` takes the faster
  of the two per batch size (ROUTER_MAX_T), from this part's numbers.
- qkv: the q/k/v projection, q/k norm, RoPE and cache write in one launch
  (`fused_qkv_norm_rope_cache`) vs cuBLAS's GEMM then `qk_norm_rope_cache`, the same way; likewise
  behind QKV_MAX_T. Both fused kernels also without PDL ("triton, no PDL"): their own time,
  not overlapped with the next layer's launch.
- one_token: a batch-1 step's fused kernels vs the launches they replaced, and the step under the
  choices they leave open (tile shapes, the norm's place, PDL): bench_one_token.py.
- step_knobs: the step's graph replay under the knobs whose best value may move with the batch or
  the context (the attention's tile, the expert GEMMs' stages, loads ahead), over those cases:
  bench_step_knobs.py (`--knob-sets`).
- importance / paged: kernels/benchmarks/bench_importance.py and bench_paged_attention.py.
The row format, `row` and `print_row`, is shared with those modules.
- decode: the engine's decode step (CUDA graphs) over a 48-layer random model, batch 1/4/16/64,
  policies topk, sere K'=2 (rho 0, protection on, random similarity) and oea k0=2, every policy on
  the same prompts: wall time of engine.step() (TPOT) one step at a time and pipelined (async
  scheduling, the engine's default; over the same tokens again), and the graph replay alone, with
  the union each policy produced in each window (union, union_pipelined). One more
  topk row is the same-run reference for programmatic dependent launch
  (`kernels/dependent_launch.py`): "topk, no PDL", every kernel launched after the one before has
  finished.
- prefill: the same engine prefilling 30 images' visual tokens (256 merged tokens each) at keep
  1.0 and 0.6 plus 64 text tokens, to the first token.
Writes OUT.json ({"device", "copy_gbps", "rows": [...]}) and OUT.png (`plots.py`: a panel per kind of row).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from functools import partial
from pathlib import Path

import torch

from zipmoe.engine.engine import EngineConfig, LLMEngine
from zipmoe.engine.multimodal import VisualInputs
from zipmoe.engine.routing import OeaPolicy, RoutingPolicy, SerePolicy
from zipmoe.engine.sequence import SamplingParams
from zipmoe.kernels import dependent_launch
from zipmoe.kernels.layer_ops import qk_norm_rope_cache, topk_softmax
from zipmoe.kernels.qkv_norm_rope import fused_qkv_norm_rope_cache
from zipmoe.kernels.router import fused_router
from zipmoe.kernels.sere_reroute import launch_sere, sere_reroute, sere_reroute_reference

from zipmoe.checkpoint import TextConfig
from zipmoe.plotting import write_plot
from zipmoe.serve import REAL_SHAPE_CHECKPOINT

from .plots import plot
from .timing import copy_gbps, cuda_time_us, graph_time_us, require_cuda

# Qwen3-VL-30B-A3B's text decoder, with dummy weights (zipmoe.dummy_weights: routing skewed as trained).
CFG = TextConfig.from_dir(REAL_SHAPE_CHECKPOINT)
DECODE_BATCHES = (1, 4, 16, 64)  # 4: about where the business rate decodes (is SERE worth its kernel there?)


def decoder_bytes(cfg: TextConfig, union_per_layer: float, batch: int, context: int) -> int:
    """Bytes one decode step must read: attention and router weights, the union's experts, the
    LM head, and every sequence's K/V (bf16)."""
    H, D = cfg.hidden_size, cfg.head_dim
    attn = (2 * cfg.num_heads * D * H + 2 * cfg.num_kv_heads * D * H) * 2
    router = cfg.num_experts * H * 2
    expert = 3 * cfg.moe_intermediate_size * H * 2
    kv = batch * context * 2 * cfg.num_kv_heads * D * 2
    per_layer = attn + router + union_per_layer * expert + kv
    return int(cfg.num_layers * per_layer + cfg.vocab_size * H * 2)


def row(bench: str, impl: str, batch: int, time_us: float, bytes_read: int, policy: str = "", union: float = 0.0,
        **extra) -> dict:
    return {"bench": bench, "impl": impl, "batch": batch, "policy": policy, "union": float(union),
            "time_us": round(time_us, 2), "bytes_read": int(bytes_read),
            "gbps": round(bytes_read / time_us / 1e3, 1) if bytes_read else 0.0, **extra}


def bench_sere() -> list[dict]:
    from .bench_moe import random_layers, skewed_routing  # here: bench_moe imports this module

    g = torch.Generator(device="cuda").manual_seed(0)
    E = CFG.num_experts
    _, gate, direction = random_layers(0)
    sim = torch.rand(E, E, generator=g, device="cuda")
    sim = (sim + sim.T) / 2
    protect = torch.rand(E, generator=g, device="cuda") < 0.125
    rows = []
    # The kernel as the engine launches it, other launch shapes (tokens per program, warps), the reference.
    shapes = {f"triton bt={bt} w={w}": partial(launch_sere, block_t=bt, num_warps=w)
              for bt, w in ((1, 1), (1, 2), (2, 2), (4, 4), (16, 4))}
    for B in (16, 64, 128):
        _, _, ids, _ = skewed_routing(B, gate, direction, seed=B)
        for impl, fn in (("triton", sere_reroute), *shapes.items(), ("torch_reference", sere_reroute_reference)):
            us = graph_time_us(lambda: fn(ids, sim, protect, None, 2, 0.0), calls=48)
            nbytes = ids.numel() * 8 * 2 + E * E * 4
            rows.append(row("sere_kernel", impl, B, us, nbytes, "sere K'=2 rho=0"))
            print_row(rows[-1])
    return rows


def layer_weights(shape: tuple[int, int], seed: int = 0) -> list[torch.Tensor]:
    """One random bf16 weight per layer (scaled by its input width), so each is read from memory once a replay."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(shape, generator=g, device="cuda", dtype=torch.bfloat16) * shape[1] ** -0.5
            for _ in range(CFG.num_layers)]


def per_layer_rows(bench: str, batch: int, impls, weights: list[torch.Tensor], bytes_read: int) -> list[dict]:
    """impls: (name, fn(weight)); each timed over every layer's weight in one graph (L2 flushed before
    it), per layer."""
    rows = []
    for impl, fn in impls:
        us = graph_time_us(lambda: [fn(w) for w in weights], calls=1, flush_l2=True) / len(weights)
        rows.append(row(bench, impl, batch, us, bytes_read))
        print_row(rows[-1])
    return rows


def without_pdl(fn):
    """fn with its kernels launched one after another (the setting is read at each launch, so in a
    capture too)."""
    def run(*args):
        with dependent_launch.enabled_as(False):
            return fn(*args)
    return run


def _activation(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, device="cuda", dtype=torch.bfloat16)


def bench_router(batches=(1, 16, 64, 128)) -> list[dict]:
    """Per layer: 48 layers' gates (24 MiB), the GEMM and top-K in one launch against cuBLAS's GEMM
    then `topk_softmax`."""
    E, H, K = CFG.num_experts, CFG.hidden_size, CFG.top_k
    gates = layer_weights((E, H))
    rows = []
    for B in batches:
        x = _activation(B, H)
        rows += per_layer_rows("router", B, (
            ("triton", lambda gate: fused_router(x, gate, K, True)),
            ("triton, no PDL", without_pdl(lambda gate: fused_router(x, gate, K, True))),
            ("cublas+topk_softmax", lambda gate: topk_softmax(torch.nn.functional.linear(x, gate), K, True, x.dtype)),
        ), gates, E * H * 2 + B * H * 2)
    return rows


def bench_qkv(batches=(1, 4, 16)) -> list[dict]:
    """Per layer: 48 layers' q/k/v projections (1 GB), projection + q/k norm + RoPE + cache write in
    one launch against cuBLAS's GEMM then `qk_norm_rope_cache`."""
    H, D, hq, hkv = CFG.hidden_size, CFG.head_dim, CFG.num_heads, CFG.num_kv_heads
    weights = layer_weights(((hq + 2 * hkv) * D, H))
    norm = torch.ones(D, device="cuda", dtype=torch.bfloat16)
    k_cache, v_cache = (torch.zeros(1024, hkv, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    rows = []
    for B in batches:
        x, cos, sin = _activation(B, H), _activation(B, D), _activation(B, D)
        args = (norm, norm, cos, sin, k_cache, v_cache, torch.arange(B, device="cuda"), 1e-6, hq, hkv)
        rows += per_layer_rows("qkv", B, (
            ("triton", lambda w: fused_qkv_norm_rope_cache(x, w, *args)),
            ("triton, no PDL", without_pdl(lambda w: fused_qkv_norm_rope_cache(x, w, *args))),
            ("cublas+qk_norm_rope_cache", lambda w: qk_norm_rope_cache(torch.nn.functional.linear(x, w), *args)),
        ), weights, weights[0].numel() * 2 + B * H * 2)
    return rows


def random_sere(device: torch.device, seed: int = 0) -> SerePolicy:
    """Random similarity (random experts are nearly equally unlike anyway), 1/8 protected, rho 0."""
    g = torch.Generator(device=device).manual_seed(seed)
    L, E = CFG.num_layers, CFG.num_experts
    sim = torch.rand(L, E, E, generator=g, device=device)
    sim = (sim + sim.transpose(1, 2)) / 2
    protect = torch.rand(L, E, generator=g, device=device) < 0.125
    return SerePolicy(sim, protect, {i: i for i in range(L)}, primary_k=2, threshold=0.0, use_protect=True)


def build_engine(max_num_seqs: int = 64) -> LLMEngine:
    # One step at a time unless a row turns pipelining on (bench_decode's engine_step_async rows).
    config = EngineConfig(device="cuda", dtype="bfloat16", load_format="dummy", num_kv_blocks=4096, max_num_seqs=max_num_seqs,
                          max_model_len=16384, max_num_batched_tokens=16384, max_tokens_cap=4096,
                          async_scheduling=False)
    t0 = time.perf_counter()
    engine = LLMEngine(REAL_SHAPE_CHECKPOINT, config, policy=RoutingPolicy())
    print(f"dummy 30B-shaped engine + CUDA graphs: {time.perf_counter() - t0:.1f} s, "
          f"{torch.cuda.memory_allocated() / 2**30:.1f} GiB", flush=True)
    return engine


def union_between(before: dict, after: dict) -> float:
    """Distinct experts a MoE layer-step read between two `routing_stats` snapshots."""
    return (after["union_after"] - before["union_after"]) / max(1, after["layer_steps"] - before["layer_steps"])


def pipelined_step_us(engine: LLMEngine, steps: int) -> float:
    """Async scheduling: steps pipelined, each launched before the last one's tokens are read back;
    per step, the wall time of `steps` of them (one more is in flight at the end)."""
    engine.set_async_scheduling(True)
    engine.step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    us = (time.perf_counter() - t0) * 1e6 / steps
    engine.set_async_scheduling(False)
    return us


def decoding(engine: LLMEngine, prompts: list[list[int]], max_tokens: int, steps: int = 3) -> list:
    """Sequences of these prompts, prefilled and `steps` steps into their decode: after three the
    graph of their batch's bucket holds a real decode batch (the step benchmarks and profiles time it)."""
    seqs = [engine.add_request(p, SamplingParams(max_tokens=max_tokens, ignore_eos=True)) for p in prompts]
    while any(len(s.output_ids) == 0 for s in seqs):  # prefill
        engine.step()
    for _ in range(steps):
        engine.step()
    return seqs


def drop(engine: LLMEngine, seqs: list) -> None:
    """The sequences aborted and the engine idle again."""
    for s in seqs:
        engine.abort(s)
    while engine.has_work:  # the step still in flight is read back (its tokens dropped)
        engine.step()


def bench_decode(engine: LLMEngine, gbps_copy: float, prompt: int = 256, steps: int = 24) -> list[dict]:
    dev = torch.device("cuda")
    # (row name, policy, PDL): the policies as the engine runs them, then the reference for PDL.
    variants = (("topk", RoutingPolicy(), True), ("sere K'=2 rho=0", random_sere(dev), True),
                ("oea k0=2", OeaPolicy(2), True), ("topk, no PDL", RoutingPolicy(), False))
    rows = []
    for name, policy, pdl in variants:
        with dependent_launch.enabled_as(pdl):  # the decode steps timed are these graphs' replays
            engine.set_routing_policy(policy)  # re-captures the graphs
        for B in DECODE_BATCHES:
            # The same prompts under every policy, and for both windows below: with dummy weights the
            # routing drifts along a sequence, so steps compared must cover the same tokens.
            g = torch.Generator().manual_seed(B)
            prompts = [torch.randint(0, 150000, (prompt,), generator=g).tolist() for _ in range(B)]
            seqs = decoding(engine, prompts, 2 * steps + 8)
            before = engine.routing_stats.snapshot()
            times = []
            for _ in range(steps):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                engine.step()  # samples on the host: the step ends when its tokens are known
                times.append((time.perf_counter() - t0) * 1e6)
            union = union_between(before, engine.routing_stats.snapshot())
            graphs = engine.runner.graphs
            replay_us = cuda_time_us(graphs.graphs[graphs.bucket(B)].replay, warmup=2, reps=10)
            drop(engine, seqs)
            seqs = decoding(engine, prompts, 2 * steps + 8)  # the pipelined steps over the same tokens again
            before = engine.routing_stats.snapshot()
            async_us = pipelined_step_us(engine, steps)
            union_pipelined = union_between(before, engine.routing_stats.snapshot())
            drop(engine, seqs)
            context = prompt + 3 + steps  # at the end of the timed plain steps (the pipelined ones: one more)
            for impl, us, ctx in (("engine_step", statistics.median(times), context),
                                  ("engine_step_async", async_us, context + 1),
                                  ("graph_replay", replay_us, context)):
                nbytes = decoder_bytes(CFG, union, B, ctx)
                rows.append(row("decode_step", impl, B, us, nbytes, name, union, context=ctx,
                                weight_read_us=round(nbytes / gbps_copy / 1e3, 1),
                                union_pipelined=round(union_pipelined, 2)))
                print_row(rows[-1])
    engine.set_routing_policy(RoutingPolicy())
    return rows


def bench_prefill(engine: LLMEngine, images: int = 30, tokens_per_image: int = 256, text: int = 64) -> list[dict]:
    H, dev = CFG.hidden_size, torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    rows = []
    for keep in (1.0, 0.6):
        V = round(images * tokens_per_image * keep)
        ids = list(range(1000, 1000 + text // 2)) + [CFG.image_token_id] * V + list(range(2000, 2000 + text // 2))
        visual = VisualInputs(
            embeds=torch.randn(V, H, generator=g, device=dev, dtype=torch.bfloat16),
            deepstack=torch.randn(3, V, H, generator=g, device=dev, dtype=torch.bfloat16) * 0.1,
            positions=torch.arange(len(ids)).expand(3, -1), rope_delta=0)
        times = []
        for i in range(4):
            seq = engine.add_request(ids, SamplingParams(max_tokens=1), visual=visual)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            engine.step()
            torch.cuda.synchronize()
            if i:  # the first one warms up the prefill-shaped kernels
                times.append((time.perf_counter() - t0) * 1e6)
            assert seq.finished
        rows.append(row("prefill_30img", "decoder_prefill", 1, statistics.median(times), 0, f"keep {keep}",
                        prompt_tokens=len(ids), visual_tokens=V))
        print_row(rows[-1])
    return rows


def print_row(r: dict) -> None:
    extra = f"  union {r['union']:6.2f}" if r["union"] else ""
    bw = f"  {r['gbps']:7.1f} GB/s" if r["gbps"] else ""
    print(f"{r['bench']:14s} {r['impl']:22s} {r['policy']:18s} batch {r['batch']:4d}  {r['time_us']:10.1f} us{bw}{extra}",
          flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="docs/results/kernels_h200")
    ap.add_argument("--parts", default="decode,prefill,moe,sere,router,qkv,importance,paged")
    ap.add_argument("--sweep", action="store_true", help="time the fused kernels' tile shapes instead")
    ap.add_argument("--knob-sets", default="attention,tiles,ahead", help="the step_knobs part's sets")
    args = ap.parse_args(argv)
    require_cuda(ap)
    parts = set(args.parts.split(","))
    torch.manual_seed(0)
    gbps = copy_gbps()
    print(f"device {torch.cuda.get_device_name()}: copy_ {gbps:.0f} GB/s (read + write)", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {"device": torch.cuda.get_device_name(), "copy_gbps": round(gbps, 1), "rows": []}

    def save(rows: list[dict]) -> None:  # after every part: a run cut short keeps what it measured
        result["rows"] += rows
        out.with_suffix(".json").write_text(json.dumps(result, indent=1))

    if args.sweep:
        from .bench_moe import sweep_moe
        save(sweep_moe())
    else:
        if {"decode", "prefill", "one_token", "step_knobs"} & parts:
            engine = build_engine()
            if "decode" in parts:
                save(bench_decode(engine, gbps))
            if "prefill" in parts:
                save(bench_prefill(engine))
            if "one_token" in parts:
                from .bench_one_token import bench_step_variants
                save(bench_step_variants(engine))
            if "step_knobs" in parts:
                from .bench_step_knobs import bench_step_knobs
                save(bench_step_knobs(engine, args.knob_sets.split(",")))
            del engine
            torch.cuda.empty_cache()
        if "moe" in parts:
            from .bench_moe import bench_moe, bench_moe_prefill
            save(bench_moe())
            save(bench_moe_prefill())
        if "sere" in parts:
            save(bench_sere())
        if "router" in parts:
            save(bench_router())
        if "qkv" in parts:
            save(bench_qkv())
        if "one_token" in parts:
            from .bench_one_token import bench_one_token
            save(bench_one_token())
        if "importance" in parts:
            from .bench_importance import bench_importance
            save(bench_importance("cuda"))
        if "paged" in parts:
            from .bench_paged_attention import bench_paged_attention
            save(bench_paged_attention("cuda"))
        write_plot(result, out.with_suffix(".png"), plot)
    print(f"wrote {out.with_suffix('.json')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
