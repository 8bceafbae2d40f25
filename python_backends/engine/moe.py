"""Sparse MoE block pieces: router -> softmax -> top-K, and the experts (reference: a loop over the
experts the batch activates). The routing policy in between (decode only) is in routing.py."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..kernels.layer_ops import topk_softmax_reference


def route_topk(x: torch.Tensor, gate: torch.Tensor, top_k: int,
               normalize: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Router: softmax in float32 -> (probs [T, E], top-K ids sorted by score, weights renormalised when asked)."""
    return topk_softmax_reference(F.linear(x, gate), top_k, normalize, x.dtype)


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
