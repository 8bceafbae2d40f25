"""Turns a scheduled batch into model inputs, runs one forward and samples the next tokens.

A step whose every sequence computes just its newest token is a decode step: attention over the
paged cache, the routing policy, and on CUDA a replay of the batch size's CUDA graph; its routing
goes into `routing_stats`. A step with prompt chunks in it takes plain top-K routing, but for its
decode rows under a per-token policy (truncate: routing.py); its routing is not counted. On CUDA such
a step runs, by size:

  - text-only chunks with little context, the step's tokens fitting a decode graph's rows (up to
    `prompt_graph_rows`, above `max_num_seqs` in graphs of their own): a replay of that graph, each
    prompt token a row of its own (`prompt_rows`). Paged decode attention over a row's own sequence
    up to its own slot is causal attention, so the step is the same computation; what it costs is
    that each row reads its context by itself (PROMPT_ROW_CONTEXT bounds that). This is the step that
    admits short requests beside running streams: one replay, not ~900 launches;
  - up to `prefill_graph_tokens` tokens: piecewise graphs around an eager attention (prefill_graphs.py);
  - larger: eagerly.
"""
from __future__ import annotations

import time
from bisect import bisect_left

import numpy as np
import torch

from .cuda_graphs import DecodeGraphs
from .prefill_graphs import PrefillGraphs
from .kv_cache import BlockManager, KVCache
from .model import Chunk, Qwen3VLMoeTextDecoder, StepInputs
from .routing import RoutingStats
from .sampler import sample
from .scheduler import ScheduledBatch
from .sequence import Sequence

# A step's prompt rows ride a decode graph while their contexts sum to at most this many tokens: each
# row reads its context from the cache by itself (at the 30B shape 96 KiB a token over 48 layers, so
# the bound keeps that under ~6 GiB, about 1.5 ms, where the piecewise path spends ~15 ms of host time).
PROMPT_ROW_CONTEXT = 1 << 16
# How a step with prompt tokens ran, in order of preference: "pipelined" rode a decode graph launched
# behind the step in flight (async scheduling, engine.py), "decode_graph" rode one after it.
PROMPT_PATHS = ("pipelined", "decode_graph", "piecewise", "eager")


class ModelRunner:
    def __init__(self, model: Qwen3VLMoeTextDecoder, kv: KVCache, blocks: BlockManager, max_num_seqs: int,
                 max_model_len: int, cuda_graphs: bool = True, prefill_graph_tokens: int = 0,
                 prompt_graph_rows: int = 0):
        self.model = model
        self.kv = kv
        self.blocks = blocks
        self.device = model.device
        self.max_blocks = blocks.blocks_needed(max_model_len)
        self.max_num_seqs = max_num_seqs
        self.use_graphs = model.on_cuda and cuda_graphs
        self.routing_stats = RoutingStats()
        self.graphs: DecodeGraphs | None = None
        self.prompt_graph_rows = prompt_graph_rows
        self.prefill_graphs: PrefillGraphs | None = None
        self.capture_graphs()
        self.prefill_graphs = (PrefillGraphs(model, kv, prefill_graph_tokens)
                               if self.use_graphs and prefill_graph_tokens else None)
        # Prompt rows in a decode graph: not under expert parallel (untried there); benchmarks set 0 (off).
        self.prompt_row_context = PROMPT_ROW_CONTEXT if model.shard is None else 0
        # Steps with prompt tokens by path: [steps, seconds from their inputs to their tokens on the host].
        self.prompt_steps = {path: [0, 0.0] for path in PROMPT_PATHS}
        # Decode tokens those steps computed: routed top-K but under truncate, and not in routing_stats.
        self.decode_rows_beside_prompts = 0

    def capture_graphs(self) -> None:
        """(Re-)captures the decode graphs; and the prefill pieces where the policy's per_token changed
        (the pieces re-route decode rows or not as the policy was at their capture)."""
        if self.use_graphs:
            self.graphs = None  # the old graphs' memory pool goes back before the new capture
            self.graphs = DecodeGraphs(self.model, self.kv, self.max_num_seqs, self.max_blocks, self.prompt_graph_rows)
        pieces = self.prefill_graphs
        if pieces is not None and pieces.per_token != self.model.policy.per_token:
            self.prefill_graphs = None
            self.prefill_graphs = PrefillGraphs(self.model, self.kv, pieces.max_tokens, pieces.captured)

    def _tensor(self, data, dtype=torch.long) -> torch.Tensor:
        return torch.tensor(data, dtype=dtype, device=self.device)

    def prepare_mixed(self, batch: ScheduledBatch) -> tuple[torch.Tensor, StepInputs, torch.Tensor]:
        """A step that computes prompt chunks (and maybe decode tokens): all its tokens packed on one
        axis, each chunk with the cache slots of its whole context, decode rows with block tables."""
        ids, pos, slots, rows, chunks, decode = [], [], [], [], [], []
        visual_rows, embeds, deepstack = [], [], []
        row = 0
        for seq, n in batch:
            start = seq.num_cached
            ids.extend(seq.all_ids[start:start + n])
            pos.append(self._positions(seq)[:, start:start + n])
            slots.extend(self.blocks.slots(seq, start, start + n))
            if start + n == len(seq):
                rows.append(row + n - 1)  # the chunk reaches the end: this row samples the next token
            if is_decode(seq, n):
                decode.append((row, seq))
            else:
                chunks.append(Chunk(slice(row, row + n), self._tensor(self.blocks.slots(seq, 0, start + n)), start))
            if seq.visual is not None:  # the image tokens inside this chunk: a run of the visual rows
                first, last = image_span(seq, start, start + n)
                if last > first:  # (a decoding sequence's features may be in host memory: offload())
                    visual_rows.extend(row + j - start for j in seq.image_rows[first:last])
                    embeds.append(seq.visual.embeds[first:last].to(self.device, non_blocking=True))
                    if seq.visual.deepstack is not None:
                        deepstack.append(seq.visual.deepstack[:, first:last].to(self.device, non_blocking=True))
            row += n
        step = StepInputs(positions=torch.cat(pos, dim=1).to(self.device), slots=self._tensor(slots),
                          is_prefill=True, chunks=chunks)
        if decode:
            table = self.decode_batch([seq for _, seq in decode])
            step.decode_rows = self._tensor([r for r, _ in decode])
            step.block_tables = table["block_tables"].to(self.device)
            step.context_lens = table["context_lens"].to(self.device)
            if self.reroutes_beside_prompts(len(decode)):
                opt_out = torch.ones(row, dtype=torch.bool)
                opt_out[[r for r, seq in decode if not seq.opt_out]] = False
                step.opt_out = opt_out.to(self.device)
        if visual_rows:
            step.visual_rows = self._tensor(visual_rows)
            step.visual_embeds = torch.cat(embeds)
            if deepstack:
                step.deepstack = torch.cat(deepstack, dim=1)
        return self._tensor(ids), step, self._tensor(rows)

    def reroutes_beside_prompts(self, decode_rows: int) -> bool:
        """Whether a step with prompt chunks re-routes its decode rows: under a per-token policy, where a
        decode step of those rows would (routing_min_batch), so that what shares a step changes nothing."""
        return self.model.policy.per_token and decode_rows >= self.model.routing_min_batch

    @staticmethod
    def _positions(seq: Sequence) -> torch.Tensor:
        """[3, len(seq)]: the prompt's (image-aware) positions, then generated tokens at index + delta."""
        n = len(seq)
        if seq.visual is None:
            return torch.arange(n).expand(3, -1)
        prompt = seq.visual.positions
        generated = torch.arange(prompt.shape[1], n) + seq.rope_delta
        return torch.cat([prompt, generated.expand(3, -1)], dim=1)

    def decode_batch(self, seqs: list[Sequence]) -> dict[str, torch.Tensor]:
        """Host tensors of one decode step; block tables padded with block 0 (never read past a context).
        Built with numpy from each sequence's int32 table (BlockManager keeps it): a decode step's
        host work is on the critical path between two graph replays."""
        B, bs = len(seqs), self.blocks.block_size
        tables = self._tables(seqs)
        ctx = np.fromiter((len(s) for s in seqs), dtype=np.int32, count=B)
        newest = ctx.astype(np.int64) - 1
        slots = slots_at(tables, newest, bs)
        deltas = np.fromiter((s.rope_delta for s in seqs), dtype=np.int64, count=B)
        return dict(input_ids=torch.tensor([s.last_token for s in seqs]),
                    positions=torch.from_numpy(newest + deltas).expand(3, -1),
                    slots=torch.from_numpy(slots), block_tables=torch.from_numpy(tables),
                    context_lens=torch.from_numpy(ctx),
                    opt_out=torch.tensor([s.opt_out for s in seqs], dtype=torch.bool))

    @staticmethod
    def _tables(seqs: list[Sequence]) -> np.ndarray:
        """int32 [len(seqs), longest table]: each sequence's block table, padded with block 0."""
        rows = [table_row(s) for s in seqs]
        tables = np.zeros((len(rows), max(len(r) for r in rows)), dtype=np.int32)
        for i, r in enumerate(rows):
            tables[i, :len(r)] = r
        return tables

    def prepare_decode(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, StepInputs, torch.Tensor]:
        # Queued copies of fresh host tensors: a blocking copy would wait for a step still in flight.
        d = {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}
        B = d["input_ids"].shape[0]
        step = StepInputs(positions=d["positions"], slots=d["slots"], is_prefill=False, opt_out=d["opt_out"], block_tables=d["block_tables"], context_lens=d["context_lens"])
        return d["input_ids"], step, torch.arange(B, device=self.device)

    def run(self, batch: ScheduledBatch) -> list[tuple[Sequence, int]]:
        """One step; returns (sequence, next token) for each sequence whose scheduled tokens reach its
        end (a sequence still in the middle of its prompt samples nothing)."""
        if not all(is_decode(seq, n) for seq, n in batch):
            start = time.perf_counter()
            self.decode_rows_beside_prompts += sum(decode_row(seq, n) for seq, n in batch)
            sampling = [seq for seq, n in batch if seq.num_cached + n == len(seq)]
            if self.rides_decode_graph(batch):
                tensors, rows = self.prompt_rows(batch)
                logits, path = self._decode(tensors, counted=0, rows=rows), "decode_graph"  # none in routing_stats
            else:
                ids, step, rows = self.prepare_mixed(batch)
                logits, path = self._prefill(ids, step, rows)
            tokens = sample(logits, sampling).tolist()
            record = self.prompt_steps[path]
            record[0] += 1
            record[1] += time.perf_counter() - start
            return list(zip(sampling, tokens))
        return list(zip([seq for seq, _ in batch], self.launch(batch, None).tolist()))

    def rides_decode_graph(self, batch: ScheduledBatch) -> bool:
        """A step with prompt chunks runs as `prompt_rows` in a decode graph: its tokens fit the largest
        graph, no chunk holds an image token (those need the visual rows and DeepStack), and its prompt
        rows' contexts sum to at most prompt_row_context (not while a calibration hook watches the MoE)."""
        if self.graphs is None or self.model.moe_input_hook is not None:
            return False
        if sum(n for _, n in batch) > self.graphs.max_rows:
            return False
        context = 0  # the prompt rows' (a decode row reads its context in any step)
        for seq, n in batch:
            start = seq.num_cached
            first, last = image_span(seq, start, start + n)
            if last > first:  # an image token in the chunk
                return False
            if not decode_row(seq, n):
                context += n * start + n * (n + 1) // 2
        return context <= self.prompt_row_context

    def prompt_rows(self, batch: ScheduledBatch, pending: torch.Tensor | None = None) -> tuple[dict[str, torch.Tensor], list[int]]:
        """A step with prompt chunks as the host tensors of a decode step (decode_batch's), one row per
        token: the token at index i of its sequence gets that index's position, its own cache slot and
        context length i + 1 (its K/V is written before the attention reads it); every prompt row opts
        out of re-routing, decode rows too unless `reroutes_beside_prompts`. Also the rows whose logits
        sample: each sequence's row that reaches its end.
        pending: the input ids of the batch's first sequences (one decode token each) where they are
        still on the device (the step in flight's tokens, async scheduling); the rest come from the host."""
        counts = [n for _, n in batch]
        decoding = [decode_row(seq, n) for seq, n in batch]
        reroute = self.reroutes_beside_prompts(sum(decoding))
        opt_out = np.array([seq.opt_out or not (reroute and d) for (seq, _), d in zip(batch, decoding)])
        index = np.concatenate([np.arange(seq.num_cached, seq.num_cached + n) for seq, n in batch])
        tables = np.repeat(self._tables([seq for seq, _ in batch]), counts, axis=0)
        slots = slots_at(tables, index, self.blocks.block_size)
        ends = np.cumsum(counts) - 1
        known = batch if pending is None else batch[pending.shape[0]:]
        ids = torch.tensor([t for seq, n in known for t in seq.all_ids[seq.num_cached:seq.num_cached + n]])
        if pending is not None:  # queued: a blocking copy would wait for the step in flight
            ids = torch.cat([pending, ids.to(pending.device, non_blocking=True)])
        tensors = dict(input_ids=ids,
                       positions=torch.cat([self._positions(seq)[:, seq.num_cached:seq.num_cached + n]
                                            for seq, n in batch], dim=1),
                       slots=torch.from_numpy(slots), block_tables=torch.from_numpy(tables),
                       context_lens=torch.from_numpy((index + 1).astype(np.int32)),
                       opt_out=torch.from_numpy(np.repeat(opt_out, counts)))
        return tensors, [int(ends[i]) for i, (seq, n) in enumerate(batch) if seq.num_cached + n == len(seq)]

    def launch(self, batch: ScheduledBatch, input_ids: torch.Tensor | None) -> torch.Tensor:
        """A step whose every sequence samples, its next tokens left on the device ([len(batch)], queued,
        not waited for): decode tokens, then maybe whole prompts riding the decode graph as prompt_rows
        (rides_decode_graph). input_ids: the decode tokens' ids where they are still on the device (the
        previous step's result, async scheduling); None: each sequence's last token."""
        seqs = [seq for seq, _ in batch]
        if input_ids is not None and len(batch) > input_ids.shape[0]:  # prompts after the decode tokens
            tensors, rows = self.prompt_rows(batch, input_ids)
            self.decode_rows_beside_prompts += input_ids.shape[0]
            return sample(self._decode(tensors, counted=0, rows=rows), seqs)  # none in routing_stats
        tensors = self.decode_batch(seqs)
        if input_ids is not None:
            tensors["input_ids"] = input_ids
        return sample(self._decode(tensors, counted=len(seqs)), seqs)

    def _prefill(self, ids: torch.Tensor, step: StepInputs, rows: torch.Tensor) -> tuple[torch.Tensor, str]:
        """The forward of a step with prompt chunks -> (logits [len(rows), vocab], its PROMPT_PATHS name):
        replayed pieces where the step fits a bucket (not while a calibration hook watches the MoE
        inputs), else eager."""
        graphs = self.prefill_graphs
        if graphs is not None and ids.shape[0] <= graphs.max_tokens and self.model.moe_input_hook is None:
            return graphs.forward(ids, step, rows).logits, "piecewise"
        return self.model.forward(ids, step, self.kv, rows).logits, "eager"

    def _decode(self, tensors: dict[str, torch.Tensor], counted: int, rows: list[int] | None = None) -> torch.Tensor:
        """The decode forward (a CUDA-graph replay where one fits) -> logits [B, vocab] (rows given: of
        those rows); the routing of the first `counted` rows goes into routing_stats (decode tokens;
        never a graph's padding rows)."""
        if self.graphs is not None and tensors["input_ids"].shape[0] <= self.graphs.max_rows:
            out = self.graphs.run(**tensors, logit_rows=rows)
        else:
            ids, step, every = self.prepare_decode(tensors)
            out = self.model.forward(ids, step, self.kv, every if rows is None else self._tensor(rows))
        if counted:
            self.routing_stats.add_step(out.routing, counted, self.model.cfg.num_experts)
        return out.logits


def image_span(seq: Sequence, start: int, stop: int) -> tuple[int, int]:
    """[first, last): the indices into seq.image_rows (and its visual features) of the image tokens
    at prompt positions start..stop-1."""
    return bisect_left(seq.image_rows, start), bisect_left(seq.image_rows, stop)


def slots_at(tables: np.ndarray, index: np.ndarray, block_size: int) -> np.ndarray:
    """int64 cache slot of token index[i] of the sequence whose block table is tables[i]."""
    return tables[np.arange(len(index)), index // block_size].astype(np.int64) * block_size + index % block_size


def table_row(seq: Sequence) -> np.ndarray:
    """The sequence's block table as int32: BlockManager's copy, or made now when the table was
    filled some other way (tests)."""
    if seq.table_array is not None and len(seq.table_array) == len(seq.block_table):
        return seq.table_array
    return np.asarray(seq.block_table, dtype=np.int32)


def decode_row(seq: Sequence, num_tokens: int) -> bool:
    """is_decode, or the sequence's one token is the step in flight's (async scheduling): a decode row too."""
    return is_decode(seq, num_tokens) or (num_tokens == 1 and bool(seq.pending))


def is_decode(seq: Sequence, num_tokens: int) -> bool:
    """The step computes only the sequence's newest generated token: attention over the paged cache,
    routing policy (a prompt's last token, even alone, is prefill: it may be an image row)."""
    return num_tokens == 1 and seq.num_cached == len(seq) - 1 and bool(seq.output_ids)
