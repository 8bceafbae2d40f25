"""Waiting/running queues and the token budget of each step (chunked prefill, as vLLM V1 and Sarathi do it).

Every step carries each running sequence's next token(s) under one budget of
`max_num_batched_tokens`: a sequence that is decoding takes one token, a sequence whose prompt is
not yet in the KV cache takes a chunk of it (as much as the budget leaves), and waiting sequences
are admitted while budget, `max_num_seqs` and free KV blocks for their whole prompt allow, and at most
`max_new_seqs_per_step` of them into a step that already carries running sequences' tokens. So a 30-image prompt is
prefilled over several steps while the running streams keep getting a token every step, instead
of stalling them for its whole prefill. Running sequences are served oldest first, so decode
tokens come before prefill chunks. KV blocks are taken as the tokens are scheduled; when a
sequence needs a block and none is free, the most recently admitted sequence is preempted: its
blocks are freed and it is recomputed (prompt + tokens so far) when re-admitted.

Why a cap on admissions beside running sequences (off by default): every running stream waits for
the whole step, and a step's cost at MoE scale grows with its rows (more tokens pick more of the
experts, all of whose weights are read). Short prompts arriving together (streams that finish
together and ask again) make one long step that every stream sees as one long gap; a cap spreads
them over steps, for more steps that carry a prompt (docs/PERFORMANCE.md, session 25).
"""
from __future__ import annotations

from collections import deque

from .kv_cache import BlockManager
from .sequence import FinishReason, Sequence, Status

ScheduledBatch = list[tuple[Sequence, int]]  # (sequence, tokens of it computed in this step)


class Scheduler:
    def __init__(self, blocks: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_new_seqs_per_step: int = 0):
        self.blocks = blocks
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_new_seqs_per_step = max_new_seqs_per_step  # beside running sequences' tokens; 0: no cap
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        """The sequences of this step and how many of each one's tokens it computes."""
        batch: ScheduledBatch = []
        budget = self.max_num_batched_tokens
        block_size = self.blocks.block_size
        preempted = self.num_preemptions
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is not Status.RUNNING:  # preempted earlier in this pass
                continue
            if seq.pending and len(seq.output_ids) + seq.pending >= seq.params.max_tokens:
                continue  # its last token is in flight (async scheduling): it ends when that is read back
            n = min(len(seq) - seq.num_cached, budget)
            if n == 1 and seq.num_cached < len(seq.block_table) * block_size:  # a decode token, its block held
                batch.append((seq, 1))
                budget -= 1
                continue
            while not self.blocks.can_hold(seq, seq.num_cached + n):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
            else:
                self.blocks.hold(seq, seq.num_cached + n)
                batch.append((seq, n))
                budget -= n
        # A pass that had to preempt admits nobody: the freed blocks would go straight back to the
        # sequence just sent away, its chunk recomputed step after step.
        if self.num_preemptions == preempted:
            for seq, n in self.admissions(budget, self.blocks.num_free, len(self.running), bool(batch)):
                self.blocks.hold(seq, n)
                seq.status = Status.RUNNING
                self.running.append(self.waiting.popleft())
                batch.append((seq, n))
        return batch

    def admissions(self, budget: int, free_blocks: int, running: int, beside_tokens: bool) -> ScheduledBatch:
        """The waiting sequences a step admits, in order, each with its first chunk's tokens, given the
        budget and free KV blocks that the running sequences' tokens leave, how many run, and whether
        the step carries their tokens. schedule() admits exactly these; the engine asks ahead of it
        (async scheduling). A sequence is admitted only if its whole prompt can have blocks now."""
        cap = self.max_new_seqs_per_step if beside_tokens and self.max_new_seqs_per_step else len(self.waiting)
        admitted: ScheduledBatch = []
        for seq in self.waiting:
            if budget <= 0 or running + len(admitted) >= self.max_num_seqs or len(admitted) >= cap:
                break
            if self.blocks.blocks_needed(len(seq)) - len(seq.block_table) > free_blocks:
                break
            n = min(len(seq), budget)
            free_blocks -= max(0, self.blocks.blocks_needed(n) - len(seq.block_table))
            admitted.append((seq, n))
            budget -= n
        return admitted

    def _preempt(self, seq: Sequence) -> None:
        self.num_preemptions += 1
        self.running.remove(seq)
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
