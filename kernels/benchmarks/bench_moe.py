"""One MoE layer of Qwen3-30B-A3B's shape on random weights (H200): the fused kernels against their
alternatives, the align step, prompt-sized calls, and the tile sweep. A part of bench_kernels.

    python -m zipmoe.kernels.benchmarks.bench_kernels --parts moe [--out PREFIX]
    python -m zipmoe.kernels.benchmarks.bench_kernels --sweep

- moe_layer: 128 experts, top-8, hidden 2048, width 768, bf16, at batch 1..128 on skewed router
  inputs: the fused Triton kernels (in a CUDA graph, as the engine runs them, and eager),
  torch._grouped_mm, and the per-expert loop (the reference). Four copies of the layer rotate so
  that L2 never holds the next call's weights. Also under uniform routing (graphed fused kernels,
  policy "topk uniform").
- moe_align: the align step alone (graphed), at the tile height the layer picked.
- moe_prefill: 1,024 and 4,672 tokens, eager, fused Triton against torch._grouped_mm (time and TFLOP/s).
- --sweep: the fused kernels' tile shapes per batch; the fastest go to kernels/fused_moe_configs.json.
"""
from __future__ import annotations

import json

import torch
import torch.nn.functional as F

from zipmoe.kernels.layer_ops import router_reference
from zipmoe.kernels import fused_moe, moe_align
from zipmoe.kernels.fused_moe import MoeConfig, fused_experts, fused_experts_reference, fused_experts_with_config

from .bench_kernels import CFG, print_row, row
from .timing import cuda_time_us, graph_time_us

MOE_BATCHES = (1, 4, 16, 64, 128)
# Prefill-sized MoE calls: a 1k-token chunk, and a 30-image prompt at keep 0.6 (4,608 visual tokens + text).
MOE_PREFILL_TOKENS = (1024, 4672)
EXPERT_BYTES = 3 * CFG.moe_intermediate_size * CFG.hidden_size * 2


def skewed_routing(batch: int, gate: torch.Tensor, direction: torch.Tensor, seed: int):
    """Router inputs = a shared direction + noise, so popularity is skewed as in trained routers."""
    g = torch.Generator(device=gate.device).manual_seed(seed)
    x = (direction + torch.randn(batch, gate.shape[1], generator=g, device=gate.device)).bfloat16()
    probs, ids, w = router_reference(x, gate, CFG.top_k, True)
    return x, probs, ids, w


def experts_grouped_mm(x, ids, weights, gate_up, down):
    """torch._grouped_mm over slots sorted by expert (cuBLAS/CUTLASS grouped GEMM)."""
    T, K = ids.shape
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(gate_up.shape[0], dtype=torch.int32, device=x.device)
    counts.scatter_add_(0, flat.int(), torch.ones_like(flat, dtype=torch.int32))
    offs = counts.cumsum(0, dtype=torch.int32)
    tokens = order // K
    g, u = torch._grouped_mm(x[tokens], gate_up.transpose(1, 2), offs=offs).chunk(2, dim=-1)
    y = torch._grouped_mm(F.silu(g) * u, down, offs=offs) * weights.reshape(-1)[order, None]
    return torch.zeros(T, x.shape[1], dtype=torch.float32, device=x.device).index_add_(0, tokens, y.float()).to(x.dtype)


def random_layers(copies: int, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    E, I, H = CFG.num_experts, CFG.moe_intermediate_size, CFG.hidden_size

    def randn(*shape, std):
        return torch.randn(*shape, generator=g, device="cuda", dtype=torch.bfloat16) * std

    layers = [(randn(E, 2 * I, H, std=0.02), randn(E, I, H, std=0.02)) for _ in range(copies)]
    return layers, randn(E, H, std=H ** -0.5).contiguous(), torch.randn(H, generator=g, device="cuda")


def bench_moe(copies: int = 4) -> list[dict]:
    layers, gate, direction = random_layers(copies)
    rows = []
    for B in MOE_BATCHES:
        x, _, ids, w = skewed_routing(B, gate, direction, seed=B)
        union = int(torch.unique(ids).numel())
        nbytes = union * EXPERT_BYTES + 2 * x.numel() * 2

        def over_layers(fn):
            return lambda: [fn(x, ids, w, gu, dn) for gu, dn in layers]

        impls = {
            "fused_triton_graph": lambda: graph_time_us(over_layers(fused_experts), calls=1) / copies,
            "fused_triton_eager": lambda: cuda_time_us(over_layers(fused_experts)) / copies,
            "grouped_mm_eager": lambda: cuda_time_us(over_layers(experts_grouped_mm)) / copies,
            "expert_loop_eager": lambda: cuda_time_us(over_layers(fused_experts_reference), reps=5) / copies,
        }
        for impl, measure in impls.items():
            try:
                us = measure()
            except Exception as e:  # a comparator unsupported here is reported, not fatal
                print(f"moe_layer {impl} batch {B}: {type(e).__name__}: {e}")
                continue
            rows.append(row("moe_layer", impl, B, us, nbytes, "topk", union))
            print_row(rows[-1])
        # The align step alone (what the layer spends before its first GEMM), at the tile height
        # the layer picked for this batch: its share of the graphed layer time is item 3's measure.
        block_m = fused_moe.pick_config(B, CFG.num_experts, CFG.hidden_size, CFG.moe_intermediate_size, 2).block_m
        us = graph_time_us(lambda: moe_align.moe_align(ids, CFG.num_experts, block_m), calls=48)
        rows.append(row("moe_align", "triton_graph", B, us, 0, "topk", union, block_m=block_m))
        print_row(rows[-1])
        # Uniform routing, the other end from skewed: the largest union and the fewest rows per expert.
        ids, w = uniform_routing(B, ids.device, seed=B)
        union = int(torch.unique(ids).numel())
        us = graph_time_us(lambda: [fused_experts(x, ids, w, gu, dn) for gu, dn in layers], calls=1) / copies
        rows.append(row("moe_layer", "fused_triton_graph", B, us, union * EXPERT_BYTES + 2 * x.numel() * 2,
                        "topk uniform", union))
        print_row(rows[-1])
    return rows


def bench_moe_prefill(copies: int = 2) -> list[dict]:
    """The MoE layer at prompt sizes, eager as prefill steps run it: the fused Triton kernels (tuned for
    decode batches) against cuBLAS/CUTLASS grouped GEMMs. Time per layer and the TFLOP/s it reaches."""
    layers, gate, direction = random_layers(copies)
    rows = []
    for T in MOE_PREFILL_TOKENS:
        x, _, ids, w = skewed_routing(T, gate, direction, seed=T)
        flops = 2 * T * CFG.top_k * 3 * CFG.hidden_size * CFG.moe_intermediate_size
        for impl, fn in (("fused_triton_eager", fused_experts), ("grouped_mm_eager", experts_grouped_mm)):
            try:
                us = cuda_time_us(lambda: [fn(x, ids, w, gu, dn) for gu, dn in layers], reps=10) / copies
            except Exception as e:  # a comparator unsupported here is reported, not fatal
                print(f"moe_prefill {impl} {T} tokens: {type(e).__name__}: {e}")
                continue
            rows.append(row("moe_prefill", impl, T, us, 0, "topk", int(torch.unique(ids).numel()),
                            tflops=round(flops / us / 1e6, 1)))
            print_row(rows[-1])
    return rows


def uniform_routing(batch: int, device: torch.device, seed: int):
    """Every token's K experts drawn uniformly (distinct), equal bf16 weights (as the router gives)."""
    g = torch.Generator(device=device).manual_seed(seed)
    ids = torch.rand(batch, CFG.num_experts, generator=g, device=device).topk(CFG.top_k, dim=1).indices
    return ids, torch.full(ids.shape, 1.0 / CFG.top_k, dtype=torch.bfloat16, device=device)


def sweep_moe(copies: int = 4) -> list[dict]:
    """Tile shapes of the fused kernels per decode batch, timed in a graph; the fastest of each batch
    goes to kernels/fused_moe_configs.json, which `pick_config` reads."""
    layers, gate, direction = random_layers(copies, seed=1)
    rows, best = [], {}
    for B in (1, 4, 16, 64, 128):
        x, _, ids, w = skewed_routing(B, gate, direction, seed=B)
        nbytes = int(torch.unique(ids).numel()) * EXPERT_BYTES
        # Per expert a batch of B tokens brings about B x 8 / union rows (13 at 128 tokens, skewed), so
        # small row tiles are tried at every batch.
        block_ms = {1: (16,), 4: (16,), 16: (16, 32), 64: (16, 32, 64), 128: (16, 32, 64, 128)}[B]
        for bm in block_ms:
            for bn in (32, 64):
                for bk in (64, 128):
                    for warps, stages in ((4, 4), (8, 3)):
                        cfg = MoeConfig(bm, bn, bk, warps, stages)
                        try:
                            us = graph_time_us(lambda: [fused_experts_with_config(x, ids, w, gu, dn, cfg)
                                                        for gu, dn in layers], calls=1) / copies
                        except Exception as e:  # e.g. more shared memory than the device has
                            print(f"sweep {cfg}: {type(e).__name__}: {str(e)[:100]}")
                            continue
                        rows.append(row("moe_sweep", f"bm{bm}_bn{bn}_bk{bk}_w{warps}_s{stages}", B, us, nbytes))
                        print_row(rows[-1])
                        if us < best.get(B, (float("inf"),))[0]:
                            best[B] = (us, [bm, bn, bk, warps, stages])
    path = fused_moe.TUNED_CONFIGS
    table = json.loads(path.read_text()) if path.exists() else {}
    key = fused_moe.config_key(CFG.num_experts, CFG.hidden_size, CFG.moe_intermediate_size)
    table[key] = {str(b): cfg for b, (_, cfg) in sorted(best.items())}
    path.write_text(json.dumps(table, indent=1) + "\n")
    print(f"wrote {path}: {table[key]}")
    return rows
