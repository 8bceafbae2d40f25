"""Expert parallelism: which experts of every MoE layer this process holds, and how its share of a
layer's output joins the others'.

With `expert_parallel_size` N, process r of N (one per GPU; `parallel_engine.py` starts them) holds
experts [r * E/N, (r + 1) * E/N) of every MoE layer, so each GPU reads and stores 1/N of the expert
weights. Everything else (embeddings, attention, router, norms, LM head, KV cache) is replicated:
every process runs the same tokens through the same layers and gets the same hidden states and the
same routing, so a routing policy (SERE, OEA) acts on the global routing, identically everywhere,
before any expert runs. In a MoE layer each process computes the slots routed to its own experts
(the others weigh 0) and one all-reduce sums the N partial outputs. No all-to-all is needed because
every process already has every token; the cost is one all-reduce of [tokens, hidden] per MoE layer.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class ExpertShard:
    rank: int
    size: int
    num_experts: int
    group: object = None  # the torch.distributed group of the N processes (None: the default group)

    def __post_init__(self):
        if self.num_experts % self.size:
            raise ValueError(f"expert_parallel_size {self.size} must divide the model's {self.num_experts} experts")
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank {self.rank} outside expert_parallel_size {self.size}")

    @property
    def count(self) -> int:
        return self.num_experts // self.size

    @property
    def first(self) -> int:
        return self.rank * self.count

    def own(self, experts: torch.Tensor) -> torch.Tensor:
        """[E, ...] -> this process's [E/N, ...], a copy (the full tensor can be freed)."""
        return experts[self.first:self.first + self.count].clone()

    def localize(self, ids: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Global routing [T, K] -> the same slots in this process's expert numbering. A slot of another
        process's expert goes to local expert 0 with weight 0: it adds exactly nothing, and the expert
        kernels keep their one fixed shape (they compute those rows for nothing, on an expert the batch
        mostly reads anyway)."""
        local = ids - self.first
        mine = (local >= 0) & (local < self.count)
        return torch.where(mine, local, 0), torch.where(mine, weights, torch.zeros_like(weights))

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """Sums every process's share of a MoE layer's output, in place (capturable in a CUDA graph)."""
        dist.all_reduce(partial, group=self.group)
        return partial

    def agree_min(self, value: int) -> int:
        """The smallest of the processes' values (e.g. KV blocks: every process must have as many, or
        their schedulers would part ways)."""
        t = torch.tensor([value], dtype=torch.int64,
                         device="cuda" if dist.get_backend(self.group) == "nccl" else "cpu")
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item())
