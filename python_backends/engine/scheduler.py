"""Waiting/running queues: admit by free KV blocks and a token budget, prefill first, then decode.

A step is either a prefill of newly admitted sequences or one decode token for every running
sequence, so a request that arrives while others decode joins the batch at the next step.
When decode needs a block and none is free, the most recently admitted sequence is preempted:
its blocks are freed and it is recomputed (prompt + tokens so far) when re-admitted.
"""
from __future__ import annotations

from collections import deque

from .kv_cache import BlockManager
from .sequence import FinishReason, Sequence, Status


class Scheduler:
    def __init__(self, blocks: BlockManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.blocks = blocks
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> tuple[list[Sequence], bool]:
        """Returns (sequences of this step, is_prefill)."""
        batch: list[Sequence] = []
        tokens = 0
        while self.waiting and len(self.running) + len(batch) < self.max_num_seqs:
            seq = self.waiting[0]
            if batch and tokens + len(seq) > self.max_num_batched_tokens:
                break
            if not self.blocks.can_allocate(seq):
                break
            self.blocks.allocate(seq)
            seq.status = Status.RUNNING
            self.waiting.popleft()
            batch.append(seq)
            tokens += len(seq)
        if batch:
            self.running.extend(batch)
            return batch, True

        kept: list[Sequence] = []
        while self.running:
            seq = self.running.popleft()
            while not self.blocks.can_append(seq):
                if self.running:
                    self._preempt(self.running.pop())
                else:
                    self._preempt(seq)
                    break
            else:
                self.blocks.append_slot(seq)
                kept.append(seq)
        self.running.extend(kept)
        return kept, False

    def _preempt(self, seq: Sequence) -> None:
        self.num_preemptions += 1
        self.blocks.free(seq)
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """Ends a sequence wherever it is and returns its blocks at once."""
        if seq.finished:
            return
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.free(seq)
        seq.status = Status.FINISHED
        seq.finish_reason = reason
