"""Paged KV cache: fixed-size blocks, a free list, and one block table per sequence.

The same code runs on CPU and GPU: the cache is two tensors
[layers, num_blocks * block_size, kv_heads, head_dim] addressed by slot
(block * block_size + offset), so writing and gathering are plain indexing.
"""
from __future__ import annotations

from collections import deque

import numpy as np
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

    def can_hold(self, seq: Sequence, num_tokens: int) -> bool:
        """Whether the sequence's first num_tokens tokens can have cache slots (with free blocks if need be)."""
        return self.blocks_needed(num_tokens) - len(seq.block_table) <= self.num_free

    def hold(self, seq: Sequence, num_tokens: int) -> None:
        """Takes free blocks until the sequence's first num_tokens tokens have cache slots."""
        need = self.blocks_needed(num_tokens) - len(seq.block_table)
        if need > self.num_free:
            raise RuntimeError("out of KV blocks")
        if need > 0:
            seq.block_table.extend(self._free.popleft() for _ in range(need))
            seq.table_array = np.asarray(seq.block_table, dtype=np.int32)  # once a block, not once a step

    def free(self, seq: Sequence) -> None:
        self._free.extend(seq.block_table)
        seq.block_table, seq.table_array = [], None
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
