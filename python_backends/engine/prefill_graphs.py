"""Steps that carry prompt chunks, as piecewise CUDA graphs: the attention eager, the rest replayed.

Such a step (chunked prefill, often beside other sequences' decode tokens) cannot be one graph: its
attention depends on how its tokens split into sequences and contexts. Everything else in a layer
depends only on the number of tokens. So, as vLLM V1 does it, a step of up to `max_tokens` tokens
is padded to a bucket size and runs as one graph per stretch between two attentions:

    piece 0      RoPE tables, the first layer's input norm and q/k/v (k, v into the cache)
    attention    layer 0's, eager (model.attention), into a static buffer
    piece 1      layer 0's output projection, MoE, residual and norms, layer 1's q/k/v
    ...
    piece L      the last layer's output projection and MoE; then the logits, eager

At the 30B shape an eager step with a 512-token prompt beside 16 decode rows issued ~900 launches
for ~36 ms of host time against ~20 ms of GPU work; here the host issues the attention's few
launches and one replay per layer.

Padding rows (a bucket's rows past the step's tokens) keep the embeddings, positions and attention
outputs of earlier steps (finite: the buffers start at zero) and write their K/V to the cache's
scratch slot; they pass through the MoE like real rows (the padding's share of its cost) and no
logit is read from them. DeepStack features go into a dense [layers, rows, hidden] buffer that the
first layers' pieces add (zero rows where no image token is). Under a per-token routing policy
(truncate) the decode rows re-route, as eagerly: the step's opt_out goes into a static buffer too
(padding rows opt out); the pieces hold that choice, so the runner captures them again when a new
policy changes it.

A bucket's pieces are captured in replay order into one memory pool: a piece's intermediate
tensors may reuse memory an earlier piece left once nothing later reads it, as at capture time,
so a bucket costs about its largest piece's activations. Each piece's q goes to a static buffer
for the eager attention. Without CUDA graphs (`capture=False`: the CPU tests) the same pieces run
eagerly on the same buffers.
"""
from __future__ import annotations

import time
from functools import partial

import torch

from .cuda_graphs import capture, capturing
from .kv_cache import KVCache
from .model import Qwen3VLMoeTextDecoder, StepInputs, StepOutput

SMALLEST = 16
STRIDE = 256  # above STRIDE tokens buckets are its multiples: the padding stays below 256 rows


def prefill_buckets(max_tokens: int) -> list[int]:
    """Token counts with a graph: powers of two from SMALLEST to STRIDE, then multiples of STRIDE,
    then max_tokens itself."""
    sizes = {max_tokens} | {1 << i for i in range(SMALLEST.bit_length() - 1, STRIDE.bit_length())}
    sizes |= set(range(2 * STRIDE, max_tokens + 1, STRIDE))
    return sorted(s for s in sizes if s <= max_tokens)


class PrefillGraphs:
    def __init__(self, model: Qwen3VLMoeTextDecoder, kv: KVCache, max_tokens: int, capture: bool = True):
        self.model, self.kv, self.captured = model, kv, capture
        self.per_token = model.policy.per_token
        self.buckets = prefill_buckets(max_tokens)
        n, cfg, dev = self.buckets[-1], model.cfg, model.device
        self.hidden = torch.zeros(n, cfg.hidden_size, dtype=model.dtype, device=dev)  # embeddings in
        self.q = torch.zeros(n, cfg.num_heads, cfg.head_dim, dtype=model.dtype, device=dev)
        self.attn = torch.zeros_like(self.q)
        self.positions = torch.zeros(3, n, dtype=torch.long, device=dev)
        self.slots = torch.full((n,), kv.scratch_slot, dtype=torch.long, device=dev)
        self.opt_out = torch.ones(n, dtype=torch.bool, device=dev) if self.per_token else None
        self.deepstack = (torch.zeros(cfg.deepstack_layers, n, cfg.hidden_size, dtype=model.dtype, device=dev)
                          if cfg.deepstack_layers else None)
        self._deepstack_rows = False  # the buffer holds some step's features (zeroed before the next)
        self.pieces = {b: self._pieces(b) for b in self.buckets}
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        # Each bucket's last piece's output (the final norm of h, what model.logits takes), rewritten by its replay.
        self.outputs: dict[int, torch.Tensor] = {}
        if capture:
            self._capture()

    @property
    def max_tokens(self) -> int:
        return self.buckets[-1]

    def _pieces(self, b: int) -> list:
        """The bucket's pieces, each h -> h (the residual stream [b, hidden]; the last one's output is its
        final norm). They hold no reference to self, so that dropping the engine frees its graphs at
        once, not at a garbage collection."""
        m, kv, deepstack = self.model, self.kv, self.deepstack
        step = StepInputs(positions=self.positions[:, :b], slots=self.slots[:b], is_prefill=True,
                          opt_out=None if self.opt_out is None else self.opt_out[:b])
        q, attn = self.q[:b], self.attn[:b].view(b, -1)
        rope = {}  # cos/sin of piece 0, read by every later piece (under capture: piece 0's output tensors)

        def first(h: torch.Tensor) -> torch.Tensor:
            _, rope["cos"], rope["sin"], q0 = m.first_qkv(h, step, kv)
            q.copy_(q0)
            return h

        def rest(layer, nxt, h: torch.Tensor) -> torch.Tensor:
            inject = None
            if deepstack is not None and layer.idx < deepstack.shape[0]:
                inject = partial(torch.add, deepstack[layer.idx, :b])
            h, q_next = m.layer_rest(layer, nxt, h, attn, rope["cos"], rope["sin"], step, kv, [], inject)
            if q_next is not None:
                q.copy_(q_next)
            return h

        return [first] + [partial(rest, layer, nxt) for layer, nxt in zip(m.layers, m.layers[1:] + [None])]

    def _capture(self) -> None:
        dev = self.model.device
        t0, before = time.perf_counter(), torch.cuda.memory_reserved(dev)
        pool = None
        with capturing():
            # Largest first: the smaller buckets' pieces then fit in the pool the largest already holds.
            for b in reversed(self.buckets):
                pieces = self.pieces[b]
                h = self.hidden[:b]
                for piece in pieces:  # warm-up on real (zero) inputs: compiles every kernel outside the capture
                    h = piece(h)
                h, graphs = self.hidden[:b], []
                for piece in pieces:
                    graph, h = capture(partial(piece, h), pool)
                    pool = graph.pool()
                    graphs.append(graph)
                self.graphs[b], self.outputs[b] = graphs, h
        torch.cuda.synchronize(dev)
        print(f"prefill graphs: {len(self.buckets)} buckets of up to {self.max_tokens} tokens, "
              f"{len(self.buckets) * len(self.model.layers) + len(self.buckets)} pieces in "
              f"{time.perf_counter() - t0:.1f} s, "
              f"{(torch.cuda.memory_reserved(dev) - before) / 2**20:.0f} MiB", flush=True)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, step: StepInputs, logit_rows: torch.Tensor) -> StepOutput:
        """model.forward's result for a prefill step of at most max_tokens tokens."""
        T, m = input_ids.shape[0], self.model
        b = next(s for s in self.buckets if s >= T)
        self.positions[:, :T].copy_(step.positions)
        self.slots[:T].copy_(step.slots)
        self.slots[T:b].fill_(self.kv.scratch_slot)
        if self.opt_out is not None:
            self.opt_out[:b].fill_(True)
            if step.opt_out is not None:  # (None: no decode row in the step)
                self.opt_out[:T].copy_(step.opt_out)
        m.embed_tokens(input_ids, step, out=self.hidden[:T])
        self._fill_deepstack(step)
        q, attn = self.q[:T], self.attn[:T]
        if self.graphs:
            self.graphs[b][0].replay()
            for layer, graph in zip(m.layers, self.graphs[b][1:]):
                m.attention(layer, q, step, self.kv, out=attn)
                graph.replay()
            h = self.outputs[b]
        else:
            pieces = self.pieces[b]
            h = pieces[0](self.hidden[:b])
            for layer, piece in zip(m.layers, pieces[1:]):
                m.attention(layer, q, step, self.kv, out=attn)
                h = piece(h)
        return StepOutput(m.logits(h, logit_rows), [])

    def _fill_deepstack(self, step: StepInputs) -> None:
        if self.deepstack is None or (step.deepstack is None and not self._deepstack_rows):
            return
        self.deepstack.zero_()
        if step.deepstack is not None:
            self.deepstack[:step.deepstack.shape[0], step.visual_rows] = step.deepstack.to(self.deepstack.dtype)
        self._deepstack_rows = step.deepstack is not None
