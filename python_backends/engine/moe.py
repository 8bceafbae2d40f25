"""Sparse MoE block: router -> softmax -> top-K -> routing policy (decode only) -> experts.

Routing policies rewrite the (ids, weights) a batch of decode tokens sends to experts, so
that the experts activated by the whole batch can be fewer (SERE, OEA). Prefill always keeps
the router's top-K. Only `topk` exists for now; others plug in behind `RoutingPolicy`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


class RoutingPolicy:
    """Maps the router's top-K (ids, weights) of one layer's decode tokens to the slots to compute."""

    name = "base"

    def route(self, layer: int, ids: torch.Tensor, weights: torch.Tensor,
              opt_out: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError


class TopKPolicy(RoutingPolicy):
    name = "topk"

    def route(self, layer, ids, weights, opt_out):
        return ids, weights


POLICIES = {"topk": TopKPolicy}


def make_policy(name: str) -> RoutingPolicy:
    if name not in POLICIES:
        raise ValueError(f"unknown routing_policy {name!r}; choose one of {sorted(POLICIES)}")
    return POLICIES[name]()


def route_topk(x: torch.Tensor, gate: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Router: softmax in float32, top-K ids sorted by score, weights renormalised when asked."""
    logits = F.linear(x, gate)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids, weights.to(x.dtype)


def experts_reference(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                      gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """Loop over the experts the batch activates (its union); each reads its weights once.

    x [T, H]; ids/weights [T, K]; gate_up [E, 2I, H]; down [E, H, I]. A token routed twice to the
    same expert gets both weights (policies may create duplicates).
    """
    out = torch.zeros_like(x)
    for e in torch.unique(ids).tolist():
        token, slot = torch.where(ids == e)
        h = x[token]
        g, u = F.linear(h, gate_up[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(g) * u, down[e]) * weights[token, slot, None]
        out.index_add_(0, token, y.to(out.dtype))
    return out
