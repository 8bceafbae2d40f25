"""Paged KV cache: fixed-size blocks, a free list, and one block table per sequence.

The same code runs on CPU and GPU: the cache is two tensors
[layers, num_blocks * block_size, kv_heads, head_dim] addressed by slot
(block * block_size + offset), so writing and gathering are plain indexing.
"""
from __future__ import annotations

from collections import deque

import torch

from .sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, seq: Sequence) -> bool:
        return self.blocks_needed(len(seq)) <= self.num_free

    def allocate(self, seq: Sequence) -> None:
        """Blocks for every token of the sequence (prefill writes them all)."""
        assert not seq.block_table, "sequence already holds blocks"
        need = self.blocks_needed(len(seq))
        if need > self.num_free:
            raise RuntimeError("out of KV blocks")
        seq.block_table = [self._free.popleft() for _ in range(need)]

    def _needs_block(self, seq: Sequence) -> bool:
        # A decode step writes position len(seq) - 1 (the newest token).
        return len(seq) > len(seq.block_table) * self.block_size

    def can_append(self, seq: Sequence) -> bool:
        return not self._needs_block(seq) or self.num_free > 0

    def append_slot(self, seq: Sequence) -> None:
        if self._needs_block(seq):
            seq.block_table.append(self._free.popleft())

    def free(self, seq: Sequence) -> None:
        self._free.extend(seq.block_table)
        seq.block_table = []
        seq.num_cached = 0

    def slots(self, seq: Sequence, start: int, end: int) -> list[int]:
        bs = self.block_size
        table = seq.block_table
        return [table[p // bs] * bs + p % bs for p in range(start, end)]


class KVCache:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device):
        self.block_size = block_size
        # One block past the last: CUDA-graph padding rows write their K/V there, no sequence reads it.
        self.scratch_slot = num_blocks * block_size
        shape = (num_layers, (num_blocks + 1) * block_size, kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
