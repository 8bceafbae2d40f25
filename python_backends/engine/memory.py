"""How many KV-cache blocks fit: `gpu_memory_utilization` of the GPU, less the weights and a worst-case step.

After the weights are on the GPU, the engine runs the largest step it will ever run
(`max_num_batched_tokens` prompt tokens, all of them image tokens with DeepStack features, in
chunks that each end a `max_model_len` context, and `max_num_seqs` rows of logits) against a
throw-away cache, and measures the activations' peak. With prefill graphs (prefill_graphs.py) it
also runs a step of their largest size over a short context: their memory pool is held for good,
beside what eager steps use, and that step's peak bounds it from above (the graphs leave out even
its attention).
The KV cache then gets what is left of `gpu_memory_utilization` x the GPU's memory, and never more
than is free right now (other models' processes — vision_encoder, image_decode, Triton's CUDA pool —
share the GPU and keep the rest), less a fixed reserve for the CUDA graphs, the CUDA context and
the allocator's slack.

Every figure is of the model's own GPU (`model.device`; with data parallel, the one Triton gave the
instance): its total, what this process has allocated there, and what is free there. Other GPUs,
with their own engines, never count; a bare `cuda` is taken as the thread's current device.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..checkpoint import TextConfig
from .kv_cache import KVCache

RESERVE_BYTES = 1 << 30  # CUDA graphs' pool, CUDA context and libraries, allocator fragmentation
CPU_KV_BLOCKS = 1024  # without a GPU there is nothing to measure: a fixed cache (num_kv_blocks overrides)


class OutOfMemory(RuntimeError):
    """The model does not fit as configured; the message names the parameter to change."""


def block_bytes(text: TextConfig, block_size: int, dtype: torch.dtype) -> int:
    """K and V of one block in every layer."""
    return 2 * text.num_layers * block_size * text.num_kv_heads * text.head_dim * dtype.itemsize


@dataclass
class MemoryPlan:
    total: int  # the GPU's memory
    weights: int  # allocated by this process after loading
    activations: int  # peak of the worst-case step above the weights
    free: int  # free on the GPU after the worst-case step (other processes' use excluded)
    utilization: float
    device: str = "cuda"  # which GPU these figures are of, for the log line
    graphs: int = 0  # what the prefill graphs' pool and the decode graphs' kept logits will hold

    def kv_bytes(self) -> int:
        """What the cache may take: our share of the GPU and what is free, each less the step's
        activations (they come back at run time), the prefill graphs' and the reserve."""
        ours = self.utilization * self.total - self.weights - self.activations - self.graphs
        return int(min(ours, self.free - self.activations - self.graphs) - RESERVE_BYTES)

    def num_blocks(self, per_block: int) -> int:
        return max(self.kv_bytes() // per_block, 0)

    def describe(self) -> str:
        gib = 1 << 30
        return (f"{self.device} {self.total / gib:.1f} GiB x {self.utilization}: weights {self.weights / gib:.1f} GiB, "
                f"worst-case step {self.activations / gib:.2f} GiB, graphs {self.graphs / gib:.2f} GiB, "
                f"reserve {RESERVE_BYTES / gib:.1f} GiB, "
                f"free {self.free / gib:.1f} GiB -> KV cache {max(self.kv_bytes(), 0) / gib:.1f} GiB")


def worst_case_inputs(model, text: TextConfig, tokens: int, context: int, logit_rows: int, block_size: int,
                      deepstack_layers: int):
    """(ids, step, kv, rows) of the largest step: `tokens` image tokens with DeepStack features, in
    chunks that each end a `context`-token sequence and start after its first token (so they take
    the lower-right causal path, which widens K/V to every head), and `logit_rows` rows sampled."""
    from .model import Chunk, StepInputs

    device, dtype = model.device, model.dtype
    sizes = [min(context - 1, tokens - done) for done in range(0, tokens, context - 1)]
    blocks = -(-context // block_size)
    kv = KVCache(text.num_layers, blocks * len(sizes), block_size, text.num_kv_heads, text.head_dim, dtype, device)
    chunks, slots, positions, row = [], [], [], 0
    for j, n in enumerate(sizes):
        base, start = j * blocks * block_size, context - n  # sequence j's slots, and where its chunk starts
        chunks.append(Chunk(slice(row, row + n), torch.arange(base, base + context, device=device), start))
        slots.append(torch.arange(base + start, base + context, device=device))
        positions.append(torch.arange(start, context, device=device))
        row += n
    everything = torch.arange(tokens, device=device)
    step = StepInputs(positions=torch.cat(positions).expand(3, -1), slots=torch.cat(slots), is_prefill=True,
                      chunks=chunks, visual_rows=everything,
                      visual_embeds=torch.zeros(tokens, text.hidden_size, dtype=dtype, device=device),
                      deepstack=(torch.zeros(deepstack_layers, tokens, text.hidden_size, dtype=dtype, device=device)
                                 if deepstack_layers else None))
    return torch.zeros(tokens, dtype=torch.long, device=device), step, kv, everything[-min(logit_rows, tokens):]


def gpu_of(model) -> torch.device:
    """The model's GPU with its number (a bare cuda: the current device), so that no query below
    falls back to whichever device is current."""
    device = model.device
    return device if device.index is not None else torch.device("cuda", torch.cuda.current_device())


def worst_case_step(model, *inputs) -> int:
    """Peak bytes allocated during the worst-case step, above what was allocated before it (its
    throw-away cache included in the latter)."""
    ids, step, kv, rows = worst_case_inputs(model, *inputs)
    device = gpu_of(model)
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    model.forward(ids, step, kv, rows)
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - base


def plan(model, text: TextConfig, utilization: float, tokens: int, context: int, logit_rows: int, block_size: int,
         deepstack_layers: int, graph_tokens: int = 0, decode_graph_logits: int = 0) -> MemoryPlan:
    """graph_tokens: the prefill graphs' largest step (0: no prefill graphs); decode_graph_logits: the
    bytes of logits the decode graphs keep between replays (cuda_graphs.kept_logit_rows; their
    activations share one pool, within RESERVE_BYTES)."""
    device = gpu_of(model)
    weights = torch.cuda.memory_allocated(device)
    try:
        activations = worst_case_step(model, text, tokens, context, logit_rows, block_size, deepstack_layers)
        graphs = graph_tokens and worst_case_step(model, text, graph_tokens, min(context, graph_tokens + 1),
                                                  logit_rows, block_size, deepstack_layers)
    except torch.OutOfMemoryError:
        raise OutOfMemory(f"out of GPU memory in a step of max_num_batched_tokens {tokens} tokens over a context of "
                          f"max_model_len {context} (weights {weights / 2**30:.1f} GiB): lower max_num_batched_tokens "
                          "or max_model_len") from None
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    return MemoryPlan(total, weights, activations, free, utilization, str(device), graphs + decode_graph_logits)
