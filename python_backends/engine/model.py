"""Qwen3-VL-MoE text decoder over a paged KV cache.

Tokens of all sequences in a step are packed along one axis [T, hidden], and every token's K/V
is written into the cache first. A prompt chunk attends causally to its sequence's whole context
so far, read back from the cache by slot; a decode token attends over its blocks in place (paged
decode attention). Weights are read from the Hugging Face checkpoint by name
(`model.language_model.*`, `lm_head.weight`), or made up (`load_format: dummy`).
Under expert parallelism (`expert_parallel.py`) a process holds 1/N of every MoE layer's experts and
all-reduces the layers' partial outputs; everything else is the same in every process.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from types import SimpleNamespace
from typing import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from ..checkpoint import TEXT_PREFIX, TensorStore, TextConfig
from .expert_parallel import ExpertShard
from .kv_cache import KVCache
from ..kernels import layer_ops
from ..kernels import folded_router
from ..kernels.embed_rope import embed_norm_rope, embed_norm_rope_reference, norm_rope, norm_rope_reference
from ..kernels.fused_moe import fused_experts_per_slot, fused_experts_reference
from ..kernels.gemv import linear, linear_reference
from ..kernels.paged_attention import paged_decode_attention, paged_decode_attention_reference
from ..kernels.qkv_norm_rope import (add_norm_qkv, add_norm_qkv_reference, qkv_norm_rope_cache,
                                     qkv_norm_rope_cache_reference)
from ..kernels.router import add_norm_router, add_norm_router_reference
from .routing import OneTokenRoute, RoutingPolicy
from .rope import MRope

# The same steps as Triton launches (CUDA) or as their PyTorch references (CPU, and the tests).
# A MoE layer is, at one decode token (routed as the policy routes a lone token), five launches: q/k/v with its
# norms, RoPE and cache writes; the paged attention; the output projection with the residual add
# and the router's logits folded in, the gate/up GEMM that takes the norm and the top-K itself, and
# the down GEMM (`folded_moe`), which leaves the K slot outputs unsummed ([T, K, H]). The next
# layer's `add_norm_qkv` sums the slots with the residual add and its input norm. Otherwise the
# output projection (`linear`), the residual add and the MoE's input norm with the router
# (`add_norm_router`), the routing policy, and the two expert GEMMs (`experts`, which for the
# router's own distinct top-K of one token need no align). At more tokens each fused step falls
# back to its parts where those were measured faster (docs/PERFORMANCE.md). `folded_moe` None: the
# references' arithmetic, step by step (its fold rounds differently, `kernels/folded_router.py`).
# Around the layers: one launch for the embeddings, the mRoPE cos/sin and the first input norm
# (`embed_norm_rope`), and the last layer's residual add with the final norm (`add_rms_norm`).
KERNELS = SimpleNamespace(rms_norm=layer_ops.rms_norm, add_rms_norm=layer_ops.add_rms_norm,
                          embed_norm_rope=embed_norm_rope, norm_rope=norm_rope,
                          qkv_norm_rope_cache=qkv_norm_rope_cache, add_norm_qkv=add_norm_qkv, linear=linear,
                          add_norm_router=add_norm_router, experts=fused_experts_per_slot,
                          decode_attention=paged_decode_attention, folded_moe=folded_router.folded_moe)
REFERENCE = SimpleNamespace(rms_norm=layer_ops.rms_norm_reference, add_rms_norm=layer_ops.add_rms_norm_reference,
                            embed_norm_rope=embed_norm_rope_reference, norm_rope=norm_rope_reference,
                            qkv_norm_rope_cache=qkv_norm_rope_cache_reference, add_norm_qkv=add_norm_qkv_reference,
                            linear=linear_reference, add_norm_router=add_norm_router_reference,
                            experts=fused_experts_reference, decode_attention=paged_decode_attention_reference,
                            folded_moe=None)


@dataclass
class Chunk:
    """A run of one sequence's prompt tokens computed in a step (chunked prefill)."""
    rows: slice  # its rows of the packed token axis
    context_slots: torch.Tensor  # cache slots of the sequence's tokens up to the chunk's end (the chunk's own included)
    start: int  # tokens of the sequence before the chunk


@dataclass
class StepInputs:
    """What one forward needs besides token ids; built by the runner."""
    positions: torch.Tensor  # [3, T] (t, h, w) mRoPE positions
    slots: torch.Tensor  # [T] cache slot each token's K/V is written to
    is_prefill: bool  # the step computes prompt chunks: eager; top-K routing but where opt_out says
    chunks: list[Chunk] = field(default_factory=list)
    decode_rows: torch.Tensor | None = None  # prefill steps: rows that are decode tokens (None: no such row)
    block_tables: torch.Tensor | None = None  # decode rows: int32 [B, max_blocks] (padded with any block id)
    context_lens: torch.Tensor | None = None  # decode rows: int32 [B]
    # [T] bool, rows that keep their top-K: decode steps, the requests that opted out; steps with prompt
    # chunks under a per-token routing policy (RoutingPolicy.per_token), every row but the decode rows
    # that re-route (None there: no row re-routes).
    opt_out: torch.Tensor | None = None
    visual_rows: torch.Tensor | None = None  # prefill: rows of the packed axis that are image tokens
    visual_embeds: torch.Tensor | None = None  # [V, hidden] replacing those rows' embeddings
    deepstack: torch.Tensor | None = None  # [layers, V, hidden] added to those rows after the first layers


@dataclass
class StepOutput:
    """What one forward returns. In a captured CUDA graph these are the capture's tensors, which
    every replay rewrites."""
    logits: torch.Tensor  # [len(logit_rows), vocab] float32
    # Decode: (router's ids, ids computed) [T, K] of each MoE layer, for RoutingStats; prefill: [].
    routing: list[tuple[torch.Tensor, torch.Tensor]]


class Layer:
    def __init__(self, idx: int, cfg: TextConfig, store: TensorStore, dtype: torch.dtype, device: torch.device,
                 shard: ExpertShard | None = None):
        p = f"{TEXT_PREFIX}layers.{idx}."

        def w(name: str) -> torch.Tensor:
            return store.get(p + name).to(device=device, dtype=dtype)

        def experts(name: str, shape: tuple[int, ...]) -> torch.Tensor:
            """This process's experts of a fused [E, out, in] tensor (all of them without a shard)."""
            t = _expert_layout(store.get(p + name), shape)
            return (t if shard is None else shard.own(t)).to(device=device, dtype=dtype)

        self.idx = idx
        self.input_norm = w("input_layernorm.weight")
        self.post_norm = w("post_attention_layernorm.weight")
        # q, k and v projections as one matrix: one GEMM (one launch) per layer instead of three.
        self.qkv = torch.cat([w("self_attn.q_proj.weight"), w("self_attn.k_proj.weight"),
                              w("self_attn.v_proj.weight")])
        self.o = w("self_attn.o_proj.weight")
        self.q_norm = w("self_attn.q_norm.weight")
        self.k_norm = w("self_attn.k_norm.weight")
        self.is_moe = cfg.moe_layers[idx]
        if self.is_moe:
            E, H, I = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
            self.gate = w("mlp.gate.weight")
            # The router folded into the output projection (`folded_moe`); 1.5 MB a layer at the 30B shape.
            foldable = shard is None and E <= folded_router.FOLD_MAX_EXPERTS
            self.gate_r, self.gate_o = (folded_router.fold_router(self.gate, self.post_norm, self.o) if foldable
                                        else (None, None))
            self.gate_up = experts("mlp.experts.gate_up_proj", (E, 2 * I, H))
            # [E, I, H]: each expert's down projection as input rows, so that one token's gate/up programs read
            # whole rows of it (`folded_router.FUSED_DOWN`); transposed on the device, a layer at a time.
            self.down = experts("mlp.experts.down_proj", (E, H, I)).transpose(1, 2).contiguous()
        else:
            self.mlp_gate = w("mlp.gate_proj.weight")
            self.mlp_up = w("mlp.up_proj.weight")
            self.mlp_down = w("mlp.down_proj.weight")


def _expert_layout(t: torch.Tensor, expected: tuple[int, ...]) -> torch.Tensor:
    """Fused experts are [E, out, in]; checkpoints saved by transformers < 5 hold [E, in, out].

    Like transformers' own loader, a tensor already of the expected shape is taken as is.
    """
    if tuple(t.shape) == expected:
        return t
    if tuple(t.transpose(1, 2).shape) == expected:
        return t.transpose(1, 2).contiguous()
    raise ValueError(f"expert tensor of shape {tuple(t.shape)}, expected {expected}")


class Qwen3VLMoeTextDecoder:
    def __init__(self, cfg: TextConfig, store: TensorStore, dtype: torch.dtype, device: torch.device,
                 policy: RoutingPolicy, routing_min_batch: int = 1, shard: ExpertShard | None = None):
        self.cfg = cfg
        self.shard = shard  # expert parallel: this process holds and computes a slice of every MoE layer's experts
        self.dtype = dtype
        self.device = device
        self.policy = policy
        self.routing_min_batch = routing_min_batch  # smaller decode batches keep plain top-K
        self.on_cuda = device.type == "cuda"
        self.ops = KERNELS if self.on_cuda else REFERENCE
        self.embed = store.get(TEXT_PREFIX + "embed_tokens.weight").to(device=device, dtype=dtype)
        self.norm = store.get(TEXT_PREFIX + "norm.weight").to(device=device, dtype=dtype)
        if cfg.tie_word_embeddings or "lm_head.weight" not in store:
            self.lm_head = self.embed
        else:
            self.lm_head = store.get("lm_head.weight").to(device=device, dtype=dtype)
        self.layers = [Layer(i, cfg, store, dtype, device, shard) for i in range(cfg.num_layers)]
        self.rope = MRope(cfg.head_dim, cfg.rope_theta, cfg.mrope_section, device)
        self.scale = cfg.head_dim ** -0.5
        # Called as hook(layer_index, x) with each MoE layer's input [T, hidden] (offline calibration).
        self.moe_input_hook: Callable[[int, torch.Tensor], None] | None = None

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, step: StepInputs, kv: KVCache,
                logit_rows: torch.Tensor | None) -> StepOutput:
        """input_ids [T] -> logits [len(logit_rows), vocab] (float32) for the chosen rows (None: every
        row), and a decode step's routing. The stages below are also what `prefill_graphs.py` captures
        or runs between its graphs: everything but `attention` depends only on the number of tokens."""
        routing: list[tuple[torch.Tensor, torch.Tensor]] = []
        # Without image rows the first launch gathers the embeddings itself.
        h = None if step.visual_rows is None else self.embed_tokens(input_ids, step)
        h, cos, sin, q = self.first_qkv(h, step, kv, input_ids)
        injected = 0 if step.deepstack is None else step.deepstack.shape[0]
        for layer, nxt in zip(self.layers, self.layers[1:] + [None]):
            inject = partial(self._inject, step, layer.idx) if layer.idx < injected else None
            h, q = self.layer_rest(layer, nxt, h, self.attention(layer, q, step, kv), cos, sin, step, kv,
                                   routing, inject)
        return StepOutput(self.logits(h, logit_rows), routing)

    def _inject(self, step: StepInputs, idx: int, h: torch.Tensor) -> torch.Tensor:
        """DeepStack: the image rows get layer idx's visual features added."""
        h[step.visual_rows] = h[step.visual_rows] + step.deepstack[idx].to(self.dtype)
        return h

    def embed_tokens(self, input_ids: torch.Tensor, step: StepInputs, out: torch.Tensor | None = None) -> torch.Tensor:
        """[T, hidden]: the tokens' embeddings, image rows replaced by the visual features (into `out`)."""
        h = torch.index_select(self.embed, 0, input_ids, out=out) if out is not None else F.embedding(input_ids, self.embed)
        if step.visual_rows is not None:
            h[step.visual_rows] = step.visual_embeds.to(self.dtype)
        return h

    def first_qkv(self, h: torch.Tensor | None, step: StepInputs, kv: KVCache,
                  input_ids: torch.Tensor | None = None):
        """(h, cos, sin, q) of the first layer: the embeddings h (None: input_ids' rows of the table),
        the step's mRoPE cos/sin and the layer's input norm, in one launch (`kernels/embed_rope.py`); then
        its q/k/v (k and v into the cache)."""
        first, eps, rope = self.layers[0], self.cfg.rms_norm_eps, self.rope
        if h is None:
            h, x, cos, sin = self.ops.embed_norm_rope(input_ids, self.embed, first.input_norm, eps, step.positions,
                                                      rope.inv_freq, rope.axis)
        else:
            x, cos, sin = self.ops.norm_rope(h, first.input_norm, eps, step.positions, rope.inv_freq, rope.axis)
        return h, cos, sin, self._qkv(first, x, cos, sin, step, kv)

    def layer_rest(self, layer: Layer, nxt: Layer | None, h: torch.Tensor, attn: torch.Tensor, cos, sin,
                   step: StepInputs, kv: KVCache, routing: list, inject: Callable | None = None):
        """Everything of `layer` after its attention, and `nxt`'s q/k/v: (h, nxt's q), or after the last
        layer (the model's final norm of h, None), what `logits` takes. inject(h) -> h: the layer's
        DeepStack features added (the first layers)."""
        ops, cfg, eps = self.ops, self.cfg, self.cfg.rms_norm_eps
        route = self._folded_route(layer, step, attn.shape[0])
        if route is not None:
            rerouted = route.keep < cfg.top_k or route.similarity is not None
            h, out, router_ids, ids, _ = ops.folded_moe(
                h, attn, layer.o, layer.post_norm, layer.gate, layer.gate_r, layer.gate_o, layer.gate_up, layer.down,
                cfg.top_k, cfg.norm_topk_prob, route.keep, route.normalize, step.opt_out if rerouted else None, eps,
                route.similarity, route.protect, route.primary_k, route.threshold)
            routing.append((router_ids, ids))
        elif layer.is_moe:
            o = ops.linear(attn, layer.o)
            h, out = self._moe(layer, h, o, step, routing)
        else:
            h, x = ops.add_rms_norm(h, ops.linear(attn, layer.o), layer.post_norm, eps)
            out = self._mlp(layer, x)
        if nxt is not None and inject is None:
            # The residual add (and the MoE's slot sum), the next layer's input norm and its q/k/v.
            return ops.add_norm_qkv(h, out, nxt.input_norm, nxt.qkv, nxt.q_norm, nxt.k_norm, cos, sin, kv.k[nxt.idx],
                                    kv.v[nxt.idx], step.slots, eps, cfg.num_heads, cfg.num_kv_heads)
        if inject is None:  # the last layer: the residual add (and the slot sum) with the final norm
            return ops.add_rms_norm(h, out, self.norm, eps)[1], None
        h = inject(h + layer_ops.sum_slots(out).to(h.dtype))  # out: float32 sums from the fold's FUSED_DOWN
        if nxt is None:
            return ops.rms_norm(h, self.norm, eps), None
        return h, self._qkv(nxt, ops.rms_norm(h, nxt.input_norm, eps), cos, sin, step, kv)

    def _folded_route(self, layer: Layer, step: StepInputs, T: int) -> OneTokenRoute | None:
        """A MoE layer's decode step of one token takes `ops.folded_moe` (where the ops have one, no
        calibration hook reads the experts' input, all experts are here), routed as the policy routes
        a lone token (`RoutingPolicy.one_token_route`); None: the router, then the policy's `route`."""
        if (self.ops.folded_moe is None or not layer.is_moe or layer.gate_r is None or T != 1 or step.is_prefill
                or self.moe_input_hook is not None):
            return None
        if T < self.routing_min_batch:  # plain top-K at this batch
            return OneTokenRoute(self.cfg.top_k, self.cfg.norm_topk_prob)
        return self.policy.one_token_route(layer.idx, self.cfg.top_k, self.cfg.norm_topk_prob)

    def logits(self, x: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
        """float32 [len(rows), vocab] of the chosen rows (None: every row) of x, the final norm's
        output (`layer_rest` of the last layer)."""
        return F.linear(x if rows is None else x[rows], self.lm_head).float()

    def _qkv(self, layer: Layer, x: torch.Tensor, cos, sin, step: StepInputs, kv: KVCache) -> torch.Tensor:
        """Normed, rotated q [T, heads, head_dim]; k and v go straight into the cache."""
        cfg = self.cfg
        return self.ops.qkv_norm_rope_cache(x, layer.qkv, layer.q_norm, layer.k_norm, cos, sin,
                                            kv.k[layer.idx], kv.v[layer.idx], step.slots, cfg.rms_norm_eps,
                                            cfg.num_heads, cfg.num_kv_heads)

    def attention(self, layer: Layer, q: torch.Tensor, step: StepInputs, kv: KVCache,
                  out: torch.Tensor | None = None) -> torch.Tensor:
        """The heads' outputs [T, heads * head_dim] for q [T, heads, head_dim], before the output
        projection; a prefill step's go into `out` ([T, heads, head_dim]) where it is given."""
        cfg = self.cfg
        T = q.shape[0]
        k_cache, v_cache = kv.k[layer.idx], kv.v[layer.idx]
        if not step.is_prefill:
            out = self.ops.decode_attention(q, k_cache, v_cache, step.block_tables, step.context_lens,
                                            kv.block_size, self.scale)
            return out.reshape(T, -1)
        out = torch.empty_like(q) if out is None else out
        for chunk in step.chunks:
            # [1, heads, n, d] against the whole context so far, gathered from the cache.
            qc = q[chunk.rows].transpose(0, 1)[None]
            k, v = (c[chunk.context_slots].transpose(0, 1)[None] for c in (k_cache, v_cache))
            if chunk.start == 0:  # the chunk starts the sequence: plain causal attention
                o = F.scaled_dot_product_attention(qc, k, v, is_causal=True, scale=self.scale, enable_gqa=True)
            else:  # query i sits at start + i: causal aligned to the bottom right, never a materialised mask
                group = cfg.num_heads // cfg.num_kv_heads  # fused kernels take lower-right causal with equal heads
                k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
                o = F.scaled_dot_product_attention(qc, k, v, attn_mask=causal_lower_right(qc.shape[2], k.shape[2]),
                                                   scale=self.scale)
            out[chunk.rows] = o[0].transpose(0, 1)
        if step.decode_rows is not None:
            out[step.decode_rows] = self.ops.decode_attention(q[step.decode_rows], k_cache, v_cache, step.block_tables,
                                                              step.context_lens, kv.block_size, self.scale)
        return out.reshape(T, -1)

    def _moe(self, layer: Layer, h: torch.Tensor, attn_out: torch.Tensor, step: StepInputs,
             routing: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual add and the MoE's input norm with its router, the policy (decode steps:
        appends (router's ids, ids computed) to `routing`; steps with prompt chunks: a per-token
        policy at the rows `step.opt_out` leaves it), the experts: (h, out), out [T, H] or [T, K, H]
        slot outputs still to be summed (`ops.experts` of KERNELS)."""
        cfg = self.cfg
        h, x, probs, ids, weights = self.ops.add_norm_router(h, attn_out, layer.post_norm, layer.gate, cfg.top_k,
                                                             cfg.norm_topk_prob, cfg.rms_norm_eps)
        if self.moe_input_hook is not None:
            self.moe_input_hook(layer.idx, x)
        router_ids = ids
        if not step.is_prefill:
            if x.shape[0] >= self.routing_min_batch:
                ids, weights = self.policy.route(layer.idx, probs, ids, weights, step.opt_out)
            routing.append((router_ids, ids))
        elif step.opt_out is not None and self.policy.per_token:
            ids, weights = self.policy.route(layer.idx, probs, ids, weights, step.opt_out)
        if self.shard is None:
            return h, self.ops.experts(x, ids, weights, layer.gate_up, layer.down, distinct_ids=ids is router_ids)
        # Every process routed the same tokens the same way (the policy saw the global routing); each
        # computes its own experts' share and the shares are summed across processes.
        ids, weights = self.shard.localize(ids, weights)
        return h, self.shard.reduce(layer_ops.sum_slots(self.ops.experts(x, ids, weights, layer.gate_up, layer.down)))

    @staticmethod
    def _mlp(layer: Layer, x: torch.Tensor) -> torch.Tensor:
        return F.linear(F.silu(F.linear(x, layer.mlp_gate)) * F.linear(x, layer.mlp_up), layer.mlp_down)
