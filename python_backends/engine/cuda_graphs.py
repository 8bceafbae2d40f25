"""The decode forward captured in CUDA graphs, one per batch-size bucket.

A decode step of a 48-layer MoE launches a few hundred small kernels; replaying them as one
graph removes the per-launch host cost, which otherwise dominates at small batches. Everything
the step reads lives in static buffers sized for the largest bucket; a batch of B runs the
graph of the smallest bucket >= B, its extra rows padded with copies of row 0 (same token,
position, context: so they route to the same experts and the union is unchanged) whose K/V
go to the cache's scratch slot. The routing policy is part of the graph; buckets include
routing_min_batch - 1 and routing_min_batch, so a bucket decides exactly as the batch would.
Each capture's StepOutput (logits and routing) is kept: its tensors are what every replay rewrites.

Above the decode buckets (`max_num_seqs`) come prompt-row buckets, up to `prompt_graph_rows`: steps
whose short text prompts run as decode rows, one per prompt token (runner.prompt_rows). Such a step
samples at most one row per sequence, so these graphs compute logits only for `max_num_seqs` rows
named per replay (`logit_rows`): a few hundred rows of float32 logits per bucket would cost more
memory than the rest of the graphs together.
"""
from __future__ import annotations

import gc
from contextlib import contextmanager

import torch

from .kv_cache import KVCache
from .model import Qwen3VLMoeTextDecoder, StepInputs, StepOutput


def bucket_sizes(max_batch: int, routing_min_batch: int = 1) -> list[int]:
    sizes = {1, 2, 4, max_batch} | set(range(8, max_batch + 1, 8))
    sizes |= {b for b in (routing_min_batch - 1, routing_min_batch) if 1 <= b <= max_batch}
    return sorted(s for s in sizes if s <= max_batch)


def prompt_buckets(max_batch: int, max_rows: int) -> list[int]:
    """Buckets above the decode buckets for steps of prompt rows: doubling from 2 x max_batch, then
    max_rows itself (none when max_rows <= max_batch), leaving out a doubling within a quarter of it.
    Padding costs compute, not weight reads: a padding row routes as row 0 does."""
    sizes, b = [], 2 * max_batch
    while 5 * b < 4 * max_rows:
        sizes.append(b)
        b *= 2
    return sizes + [max_rows] if max_rows > max_batch else []


@contextmanager
def capturing():
    """A block of CUDA-graph captures with Python's cyclic garbage collector held off: a collection
    inside a capture that frees an earlier engine's graphs (their memory) invalidates the capture.
    Garbage from before is collected first."""
    was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def capture(fn, pool):
    """fn() captured in a new CUDA graph that draws on `pool` (None: a new pool): (graph, fn's output,
    which every replay rewrites)."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = fn()
    return graph, out


def all_buckets(max_batch: int, routing_min_batch: int, prompt_graph_rows: int) -> list[int]:
    """Every graph's rows, ascending: the decode buckets, then the prompt-row buckets."""
    return bucket_sizes(max_batch, routing_min_batch) + prompt_buckets(max_batch, prompt_graph_rows)


def kept_logit_rows(max_batch: int, routing_min_batch: int, prompt_graph_rows: int) -> int:
    """Rows of float32 logits the decode graphs keep between replays (each capture's output): a graph
    of b rows keeps min(b, max_batch), as DecodeGraphs captures them."""
    return sum(min(b, max_batch) for b in all_buckets(max_batch, routing_min_batch, prompt_graph_rows))


class DecodeGraphs:
    def __init__(self, model: Qwen3VLMoeTextDecoder, kv: KVCache, max_batch: int, max_blocks: int,
                 prompt_graph_rows: int = 0):
        self.model = model
        self.buckets = all_buckets(max_batch, model.routing_min_batch, prompt_graph_rows)
        self.max_batch = max_batch  # the largest decode step (max_num_seqs); above it, prompt rows only
        n, dev = self.buckets[-1], model.device
        self.input_ids = torch.zeros(n, dtype=torch.long, device=dev)
        self.positions = torch.zeros(3, n, dtype=torch.long, device=dev)
        self.slots = torch.full((n,), kv.scratch_slot, dtype=torch.long, device=dev)
        self.block_tables = torch.zeros(n, max_blocks, dtype=torch.int32, device=dev)
        self.context_lens = torch.ones(n, dtype=torch.int32, device=dev)
        self.opt_out = torch.zeros(n, dtype=torch.bool, device=dev)
        # A prompt-row bucket's logit rows (a decode bucket's are all its rows); every tensor a graph reads
        # must outlive it.
        self.logit_rows = torch.zeros(self.max_batch, dtype=torch.long, device=dev)
        self.scratch_slot = kv.scratch_slot
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, StepOutput] = {}
        pool, reserved = None, torch.cuda.memory_reserved(dev)
        with capturing():
            # Largest first: smaller graphs then fit in the memory pool the largest one already holds.
            for b in reversed(self.buckets):
                step, rows = self._step(b), None if b <= self.max_batch else self.logit_rows
                model.forward(self.input_ids[:b], step, kv, rows)  # compiles every kernel outside the capture
                graph, self.outputs[b] = capture(lambda: model.forward(self.input_ids[:b], step, kv, rows), pool)
                pool = graph.pool()
                self.graphs[b] = graph
        torch.cuda.synchronize()
        prompt = sum(b > self.max_batch for b in self.buckets)
        print(f"decode graphs: {len(self.buckets)} buckets of up to {self.max_rows} rows ({prompt} for prompt rows "
              f"above {self.max_batch}), {(torch.cuda.memory_reserved(dev) - reserved) / 2**20:.0f} MiB", flush=True)

    def bucket(self, rows: int) -> int:
        """The smallest bucket that holds a step of `rows` rows: its graph is graphs[bucket(rows)]."""
        return next(b for b in self.buckets if b >= rows)

    @property
    def max_rows(self) -> int:
        """The largest step of prompt rows."""
        return self.buckets[-1]

    def _step(self, b: int) -> StepInputs:
        return StepInputs(positions=self.positions[:, :b], slots=self.slots[:b], is_prefill=False,
                          block_tables=self.block_tables[:b],
                          context_lens=self.context_lens[:b], opt_out=self.opt_out[:b])

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
            block_tables: torch.Tensor, context_lens: torch.Tensor, opt_out: torch.Tensor,
            logit_rows: list[int] | None = None) -> StepOutput:
        """Host tensors of one decode batch (B rows) -> logits [B, vocab] (logit_rows given: of those
        rows only, at most max_batch of them) and the routing of the whole bucket (padding rows after
        the B real ones); valid until the next run. Above max_batch rows logit_rows is required."""
        B = input_ids.shape[0]
        b = self.bucket(B)
        if b > self.max_batch and (logit_rows is None or len(logit_rows) > self.max_batch):
            raise ValueError(f"a step of {B} prompt rows samples at most {self.max_batch} rows, got {logit_rows}")
        if logit_rows is not None:
            # A queued copy into the device buffer (a host index would wait for the steps in flight, the
            # async-scheduling one included). Every entry is written: one left from a larger bucket's step
            # could lie past this bucket's rows (a prompt-row bucket's graph reads them all).
            rows = torch.zeros(self.max_batch, dtype=torch.long)
            rows[:len(logit_rows)] = torch.tensor(logit_rows, dtype=torch.long)
            self.logit_rows.copy_(rows, non_blocking=True)
        pad = torch.zeros(b, dtype=torch.long)  # padding rows copy row 0 ...
        pad[:B] = torch.arange(B)
        slots = torch.cat([slots, torch.full((b - B,), self.scratch_slot, dtype=slots.dtype)])  # ... but write aside
        if input_ids.is_cuda:  # the step before's tokens (async scheduling): a host index would wait for it
            self.input_ids[:B].copy_(input_ids)
            self.input_ids[B:b].copy_(input_ids[:1].expand(b - B))
        else:
            self.input_ids[:b].copy_(input_ids[pad], non_blocking=True)
        self.positions[:, :b].copy_(positions[:, pad], non_blocking=True)
        self.slots[:b].copy_(slots, non_blocking=True)
        self.block_tables[:b, :block_tables.shape[1]].copy_(block_tables[pad], non_blocking=True)
        self.context_lens[:b].copy_(context_lens[pad], non_blocking=True)
        self.opt_out[:b].copy_(opt_out[pad], non_blocking=True)
        self.graphs[b].replay()
        out = self.outputs[b]
        if logit_rows is None:
            return StepOutput(out.logits[:B], out.routing)
        if b > self.max_batch:  # the graph gathered the rows itself
            return StepOutput(out.logits[:len(logit_rows)], out.routing)
        return StepOutput(out.logits.index_select(0, self.logit_rows[:len(logit_rows)]), out.routing)
