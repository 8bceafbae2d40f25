"""The one-token kernels of a batch-1 decode step against the launches each replaced, per layer at
Qwen3-30B-A3B's shape (H200): 48 layers' weights in one CUDA graph, L2 flushed before it.

    python -m zipmoe.kernels.benchmarks.bench_kernels --parts one_token

- out_proj: the attention's output projection as one GEMV launch (`gemv.gemv`) vs cuBLAS
  (split over the input width, then a second kernel summing the splits);
- add_norm_router: the residual add and the MoE's input norm inside the router's launch
  (`router.fused_add_norm_router`) vs `layer_ops.add_rms_norm` then `router.fused_router`;
- add_norm_qkv: the residual add with the MoE's 8 slot outputs and the next layer's input norm
  inside the q/k/v launch (`qkv_norm_rope.fused_add_norm_qkv`) vs `add_rms_norm` then
  `fused_qkv_norm_rope_cache`.
Rows as `bench_kernels.row` makes them (bench, impl, batch 1, time_us per layer).

`bench_step_variants` times the batch-1 step itself under the choices these kernels leave open,
in one engine (its graphs captured again for each, the committed choices first and last, so
drift shows): "step_variant" rows, policy the variant's name, graph replay and pipelined step.
The variants: the router apart from the output projection (`folded_moe` off: the output
projection, the router with the norm, and the experts as four launches); the expert GEMMs' default
tile shape where the device has a tuned one (`fused_moe.pick_config`), and the fold's at the
tuned 4 stages (`folded_router.FOLD_STAGES`); the q/k/v launch's norm
apart (two launches); the attention's keys a tile, its first tile loaded after its wait
(`paged_attention.keys_ahead` off), and its merge four splits a round (`MERGE_AT_ONCE` 4); the
whole step without PDL; none and all of the q/k/v, output projection and down GEMM programs'
weights loaded ahead of their wait (half is committed, `dependent_launch.load_ahead`); the down
GEMM as its own launch (`folded_router.FUSED_DOWN` off), with and without its loads ahead; and
SERE and OEA (`bench_kernels`' policies) with the router folded and apart.
(Session 32 also timed the GEMV's rows a program and the q/k/v kernel's and the router's splits of
the input width: docs/PERFORMANCE.md.)
"""
from __future__ import annotations

import contextlib
from unittest import mock

import torch
import torch.nn.functional as F

from zipmoe.engine import model
from zipmoe.engine.routing import OeaPolicy, RoutingPolicy
from zipmoe.kernels import dependent_launch, folded_router, fused_moe, paged_attention, qkv_norm_rope
from zipmoe.kernels.gemv import gemv
from zipmoe.kernels.layer_ops import add_rms_norm
from zipmoe.kernels.qkv_norm_rope import fused_add_norm_qkv, fused_qkv_norm_rope_cache
from zipmoe.kernels.router import fused_add_norm_router, fused_router

from .bench_kernels import (CFG, _activation, decoding, drop, layer_weights, per_layer_rows, pipelined_step_us,
                            print_row, random_sere, row)
from .timing import cuda_time_us


def bench_one_token() -> list[dict]:
    H, D, hq, hkv, E, K = (CFG.hidden_size, CFG.head_dim, CFG.num_heads, CFG.num_kv_heads, CFG.num_experts,
                           CFG.top_k)
    eps, norm = 1e-6, torch.ones(H, device="cuda", dtype=torch.bfloat16)
    h, delta, attn = _activation(1, H), _activation(1, H), _activation(1, hq * D)
    rows = per_layer_rows("out_proj", 1, (
        ("triton gemv", lambda w: gemv(attn, w)),
        ("cublas", lambda w: F.linear(attn, w)),
    ), layer_weights((H, hq * D)), H * hq * D * 2)
    rows += per_layer_rows("add_norm_router", 1, (
        ("triton, norm inside", lambda gate: fused_add_norm_router(h, delta, norm, gate, K, True, eps)),
        ("add_rms_norm+triton", lambda gate: fused_router(add_rms_norm(h, delta, norm, eps)[1], gate, K, True)),
    ), layer_weights((E, H)), E * H * 2)
    slots = _activation(1, K, H)
    qn = torch.ones(D, device="cuda", dtype=torch.bfloat16)
    k_cache, v_cache = (torch.zeros(1024, hkv, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    cos, sin, cache_slots = _activation(1, D), _activation(1, D), torch.arange(1, device="cuda")
    args = (qn, qn, cos, sin, k_cache, v_cache, cache_slots, eps, hq, hkv)
    rows += per_layer_rows("add_norm_qkv", 1, (
        ("triton, norm inside", lambda w: fused_add_norm_qkv(h, slots, norm, w, *args)),
        ("add_rms_norm+triton", lambda w: fused_qkv_norm_rope_cache(add_rms_norm(h, slots, norm, eps)[1], w, *args)),
    ), layer_weights(((hq + 2 * hkv) * D, H)), (hq + 2 * hkv) * D * H * 2)
    return rows


def _norm_apart(h, delta, norm, weight, q_norm, k_norm, cos, sin, k_cache, v_cache, slots, eps, hq, hkv):
    """`fused_add_norm_qkv`'s contract in two launches: `add_rms_norm`, then the q/k/v kernel."""
    h, x = add_rms_norm(h, delta, norm, eps)
    return h, fused_qkv_norm_rope_cache(x, weight, q_norm, k_norm, cos, sin, k_cache, v_cache, slots, eps, hq, hkv)


def _down_not_ahead(*args, ready=None, **kwargs):
    """`fused_moe.down_per_slot` as `folded_moe` calls it, without the routing's ready flag: its
    programs load nothing before their wait."""
    return fused_moe.down_per_slot(*args, **kwargs)


def keys_a_tile(keys: int):
    """`paged_attention._tile_config` with another tile of keys, its warps and stages as committed."""
    committed = paged_attention._tile_config
    return lambda head_dim, block_size: (max(block_size, keys),) + committed(head_dim, block_size)[1:]


def _variants() -> list[tuple[str, list, bool, RoutingPolicy]]:
    """(name, [(object, attribute, value)] patched while its graphs are captured, PDL, policy)."""
    topk, sere, oea = RoutingPolicy(), random_sere(torch.device("cuda")), OeaPolicy(2)
    apart = [(model.KERNELS, "folded_moe", None)]
    return [
        ("as committed", [], True, topk),
        ("router apart (not folded)", apart, True, topk),
        ("expert tiles untuned (default shape)", [(fused_moe, "_tuned", lambda key: {})], True, topk),
        ("fold's expert GEMMs at 4 stages", [(folded_router, "FOLD_STAGES", 4)], True, topk),
        ("norm apart from q/k/v", [(qkv_norm_rope, "fused_add_norm_qkv", _norm_apart)], True, topk),
        ("attention 128 keys a tile", [(paged_attention, "_tile_config", keys_a_tile(128))], True, topk),
        ("attention's keys loaded after the wait", [(paged_attention, "keys_ahead", False)], True, topk),
        ("attention merging four splits a round", [(paged_attention, "MERGE_AT_ONCE", 4)], True, topk),
        ("no PDL", [], False, topk),
        ("no weights loaded ahead of the wait", [(dependent_launch, "load_ahead", 0.0)], True, topk),
        ("all weights loaded ahead of the wait", [(dependent_launch, "load_ahead", 1.0)], True, topk),
        ("down GEMM its own launch", [(folded_router, "FUSED_DOWN", False)], True, topk),
        ("down GEMM its own launch without loads ahead",
         [(folded_router, "FUSED_DOWN", False), (folded_router, "down_per_slot", _down_not_ahead)], True, topk),
        ("sere K'=2 rho=0, folded", [], True, sere),
        ("sere K'=2 rho=0, router apart", apart, True, sere),
        ("oea k0=2, folded", [], True, oea),
        ("oea k0=2, router apart", apart, True, oea),
        ("as committed", [], True, topk),
    ]


def capture_with(engine, patches: list, pdl: bool, policy: RoutingPolicy) -> None:
    """The engine's graphs captured again with each (object, attribute, value) of patches set and
    PDL on or off; the attributes restored after (the graphs keep what they captured)."""
    with contextlib.ExitStack() as patched, dependent_launch.enabled_as(pdl):
        for obj, attr, value in patches:
            patched.enter_context(mock.patch.object(obj, attr, value))
        engine.set_routing_policy(policy)


def bench_step_variants(engine, steps: int = 40) -> list[dict]:
    """The batch-1 step under each of `_variants`, graph replay and pipelined."""
    g = torch.Generator().manual_seed(0)
    rows = []
    for name, patches, pdl, policy in _variants():
        capture_with(engine, patches, pdl, policy)
        seqs = decoding(engine, [torch.randint(0, 150000, (256,), generator=g).tolist()], 2 * steps)
        replay = cuda_time_us(engine.runner.graphs.graphs[1].replay, warmup=3, reps=30)
        pipelined = pipelined_step_us(engine, steps)
        drop(engine, seqs)
        for impl_name, us in (("graph_replay", replay), ("engine_step_async", pipelined)):
            rows.append(row("step_variant", impl_name, 1, us, 0, name))
            print_row(rows[-1])
    engine.set_routing_policy(RoutingPolicy())
    return rows
