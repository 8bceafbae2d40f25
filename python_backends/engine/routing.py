"""Batch-aware routing policies for decode steps: fewer distinct experts per layer, same weights.

In a decode batch every distinct expert costs one read of its weights, so what matters is the
union of experts the batch activates, not each token's top-K. A policy rewrites one MoE layer's
(ids, weights) for the T tokens of a decode step. Prompt tokens never re-route. A step that carries
prompt chunks beside decode tokens re-routes those only under a per-token policy (`truncate`): a
batch-aware one would save nothing there, the chunk's tokens reading most experts anyway.

- `topk`: the router's choice, unchanged.
- `sere` (arXiv 2602.07616): the batch's primary set P = union of every token's first K' experts;
  a secondary slot (rank >= K') holding e keeps e if e is in P or protected, else moves to the
  most similar p in P when sim[e, p] >= rho. Weights stay; a duplicate id simply adds up.
- `oea` (arXiv 2511.02237): each token keeps its top-k0; its other slots may only take experts the
  batch already uses (union of everyone's top-k0), best-scoring first; weights renormalised.
- `truncate`: every token keeps its first k experts (the baseline the others are measured against).

Tokens of requests that opted out keep their top-K (they still contribute primaries).
`RoutingStats` sums, per decode step, the unions before and after the policy (ModelRunner keeps it).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels.oea_reroute import oea_reroute, oea_reroute_reference
from ..kernels.sere_reroute import sere_reroute, sere_reroute_reference


class RoutingStats:
    """Sums over decode layer-steps; their ratios are the mean union before/after re-routing.

    Accumulated on the routing's device with a few ops per step (not per layer), so counting never
    waits for the GPU. `snapshot()` reads them back with one sync. Each step launched to be read back
    later (engine.py, async scheduling) queues a copy of the sums beside its tokens (`queue_copy`),
    and its read-back hands it over (`landed`): `snapshot(wait=False)` returns those, exact as of the
    last step whose tokens were read, without waiting for the step in flight (whose tokens a sync
    would hold back, with the other streams' tokens of the step before).
    """
    FIELDS = ("layer_steps", "union_before", "union_after", "rerouted_slots")

    def __init__(self):
        self._sums: torch.Tensor | None = None
        self._read = [0] * len(self.FIELDS)  # the sums as last read on the host

    def add_step(self, routed: list[tuple[torch.Tensor, torch.Tensor]], rows: int, num_experts: int) -> None:
        """routed: (router's ids, ids computed) [T, K] of each MoE layer in one decode step; only the
        first `rows` rows count (CUDA-graph batches are padded with copies of a real row)."""
        if not routed:
            return
        before = torch.stack([b for b, _ in routed])[:, :rows]
        union_before = _union_sizes(before, num_experts)
        if all(a is b for b, a in routed):  # the policy left every layer alone: nothing more to count
            union_after, moved = union_before, torch.zeros_like(union_before)
        else:
            after = torch.stack([a for _, a in routed])[:, :rows]
            union_after, moved = _union_sizes(after, num_experts), (before != after).sum()
        step = torch.stack([torch.full_like(union_before, len(routed)), union_before, union_after, moved])
        if self._sums is None:
            self._sums = torch.zeros(len(self.FIELDS), dtype=torch.int64, device=step.device)
        self._sums += step

    def queue_copy(self) -> torch.Tensor | None:
        """A pinned host copy of the sums, queued on the current stream (None: nothing to copy, or on the
        host already); hand it to `landed` once the stream has passed it."""
        if self._sums is None or not self._sums.is_cuda:
            return None
        return torch.empty_like(self._sums, device="cpu", pin_memory=True).copy_(self._sums, non_blocking=True)

    def landed(self, host: torch.Tensor | None) -> None:
        """host: a `queue_copy()` whose copy has landed. The sums only grow, so an older read never wins."""
        if host is not None:
            self._read = [max(a, b) for a, b in zip(self._read, host.tolist())]

    def snapshot(self, wait: bool = True) -> dict[str, int]:
        """The sums: read now (wait; a sync with the GPU), or as last landed (wait False)."""
        if self._sums is not None and (wait or not self._sums.is_cuda):
            self._read = self._sums.tolist()
        return dict(zip(self.FIELDS, self._read))


def _union_sizes(ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """ids [L, T, K] -> distinct experts summed over the L layers (a device scalar)."""
    L = ids.shape[0]
    seen = torch.zeros(L, num_experts, dtype=torch.bool, device=ids.device)
    return seen.scatter_(1, ids.reshape(L, -1), True).sum()


@dataclass(frozen=True)
class OneTokenRoute:
    """How a policy routes a decode step's lone token inside the expert kernels
    (`kernels/folded_router.py`): it keeps the first `keep` experts of its top-K, the other slots at
    its first expert with weight 0 (weights renormalised over the kept where `normalize`); with
    `similarity`, it keeps all K and moves its slots from `primary_k` on as SERE does, to the most
    similar of its first `primary_k` experts (a token alone is its batch's primary set)."""
    keep: int
    normalize: bool
    similarity: torch.Tensor | None = None  # the layer's [E, E] float32
    protect: torch.Tensor | None = None  # the layer's [E] bool
    primary_k: int = 0
    threshold: float = 0.0


class RoutingPolicy:
    name = "topk"
    # Whether each token's result depends on that token alone (truncate). Such a policy also acts on the
    # decode rows of a step with prompt chunks (model.py, runner.py), so that a request's routing never
    # depends on what shares its step (issue 18's harness reads truncation's cost from every token).
    per_token = False

    def one_token_route(self, layer: int, top_k: int, normalize: bool) -> OneTokenRoute | None:
        """What the policy does to decode layer `layer`'s lone token, where the expert kernels can do
        it (`OneTokenRoute`); model.py then routes there. None: it does something else (the router,
        then `route`)."""
        return OneTokenRoute(top_k, normalize)

    def route(self, layer: int, probs: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
              opt_out: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """probs [T, E] router softmax; ids/weights [T, K] top-K sorted by score -> new (ids, weights)."""
        return ids, weights


class SerePolicy(RoutingPolicy):
    name = "sere"

    def __init__(self, similarity: torch.Tensor, protect: torch.Tensor, layer_rows: dict[int, int],
                 primary_k: int = 2, threshold: float = 0.5, use_protect: bool = True):
        self.similarity = similarity  # [L_moe, E, E]
        self.protect = protect if use_protect else torch.zeros_like(protect)  # [L_moe, E] bool
        self.layer_rows = layer_rows  # decoder layer index -> row of the tables
        self.primary_k = primary_k
        self.threshold = threshold

    def one_token_route(self, layer, top_k, normalize):
        if self.primary_k >= top_k:
            return OneTokenRoute(top_k, normalize)
        row = self.layer_rows[layer]
        return OneTokenRoute(top_k, normalize, self.similarity[row], self.protect[row], self.primary_k,
                             self.threshold)

    def route(self, layer, probs, ids, weights, opt_out):
        if self.primary_k >= ids.shape[1]:
            return ids, weights
        row = self.layer_rows[layer]
        # One Triton launch on CUDA (bit-identical to the reference, which CPU runs).
        reroute = sere_reroute if ids.is_cuda else sere_reroute_reference
        return reroute(ids, self.similarity[row], self.protect[row], opt_out, self.primary_k, self.threshold), weights


class OeaPolicy(RoutingPolicy):
    name = "oea"

    def __init__(self, k0: int = 2, normalize: bool = True):
        self.k0 = k0
        self.normalize = normalize

    def one_token_route(self, layer, top_k, normalize):
        # Alone, a token's top-k0 is the whole union: its other slots find no candidate.
        return OneTokenRoute(top_k, normalize) if self.k0 >= top_k else OneTokenRoute(self.k0, self.normalize)

    def route(self, layer, probs, ids, weights, opt_out):
        if self.k0 >= ids.shape[1]:
            return ids, weights
        # One Triton launch on CUDA (the same ids as the reference, which CPU runs).
        reroute = oea_reroute if ids.is_cuda else oea_reroute_reference
        return reroute(probs, ids, weights, opt_out, self.k0, self.normalize)


class TruncatePolicy(RoutingPolicy):
    """Every token keeps only its first k experts (the baseline SERE is measured against): the other
    slots point at the token's first expert with weight 0, weights renormalised over the k kept."""
    name = "truncate"
    per_token = True

    def __init__(self, k: int = 2, normalize: bool = True):
        self.k = k
        self.normalize = normalize

    def one_token_route(self, layer, top_k, normalize):
        if self.k >= top_k:
            return OneTokenRoute(top_k, normalize)
        # The kept slots keep the router's weights, renormalised over them or not: the latter are the
        # probabilities themselves only where the router does not renormalise over its top-K.
        if self.normalize or not normalize:
            return OneTokenRoute(self.k, self.normalize)
        return None

    def route(self, layer, probs, ids, weights, opt_out):
        if self.k >= ids.shape[1]:
            return ids, weights
        keep = torch.arange(ids.shape[1], device=ids.device) < self.k
        new_ids = torch.where(keep, ids, ids[:, :1])
        new_w = torch.where(keep, weights, torch.zeros_like(weights))
        if self.normalize:
            new_w = (new_w.float() / new_w.float().sum(dim=1, keepdim=True)).to(weights.dtype)
        if opt_out is not None:
            out = opt_out[:, None]
            new_ids, new_w = torch.where(out, ids, new_ids), torch.where(out, weights, new_w)
        return new_ids, new_w


POLICIES = ("topk", "sere", "oea", "truncate")


def make_policy(name: str, top_k: int, checkpoint, device: torch.device, *, sere_primary_k: int = 2,
                sere_threshold: float = 0.5, sere_protect: bool = True, oea_k0: int = 2, truncate_k: int = 2,
                normalize: bool = True) -> RoutingPolicy:
    """The configured policy; `sere` needs the checkpoint's calibration file (a clear error without it)."""
    if name == "topk":
        return RoutingPolicy()
    if name == "oea":
        if not 1 <= oea_k0 <= top_k:
            raise ValueError(f"oea_k0 must be in [1, {top_k}], got {oea_k0}")
        return OeaPolicy(oea_k0, normalize)
    if name == "truncate":
        if not 1 <= truncate_k <= top_k:
            raise ValueError(f"truncate_k must be in [1, {top_k}], got {truncate_k}")
        return TruncatePolicy(truncate_k, normalize)
    if name == "sere":
        if not 1 <= sere_primary_k <= top_k:
            raise ValueError(f"sere_primary_k must be in [1, {top_k}], got {sere_primary_k}")
        from ..sere_file import load_sere

        tables = load_sere(checkpoint)
        rows = {layer: i for i, layer in enumerate(tables.moe_layers)}
        return SerePolicy(tables.similarity.to(device), tables.protect.to(device), rows, sere_primary_k,
                          sere_threshold, sere_protect)
    raise ValueError(f"unknown routing_policy {name!r}; choose one of {', '.join(POLICIES)}")
