"""Turns a scheduled batch into model inputs, runs one forward (eager, or a decode step's CUDA graph)
and samples one token per sequence; every decode step's routing goes into `routing_stats`."""
from __future__ import annotations

import torch

from .cuda_graphs import DecodeGraphs
from .kv_cache import BlockManager, KVCache
from .model import Qwen3VLMoeTextDecoder, StepInputs
from .routing import RoutingStats
from .sampler import sample
from .sequence import Sequence


class ModelRunner:
    def __init__(self, model: Qwen3VLMoeTextDecoder, kv: KVCache, blocks: BlockManager, max_num_seqs: int,
                 max_model_len: int, cuda_graphs: bool = True):
        self.model = model
        self.kv = kv
        self.blocks = blocks
        self.device = model.device
        self.max_blocks = blocks.blocks_needed(max_model_len)
        self.max_num_seqs = max_num_seqs
        self.use_graphs = model.on_cuda and cuda_graphs
        self.routing_stats = RoutingStats()
        self.graphs: DecodeGraphs | None = None
        self.capture_graphs()

    def capture_graphs(self) -> None:
        if self.use_graphs:
            self.graphs = None  # the old graphs' memory pool goes back before the new capture
            self.graphs = DecodeGraphs(self.model, self.kv, self.max_num_seqs, self.max_blocks)

    def _tensor(self, data, dtype=torch.long) -> torch.Tensor:
        return torch.tensor(data, dtype=dtype, device=self.device)

    def prepare_prefill(self, seqs: list[Sequence]) -> tuple[torch.Tensor, StepInputs, torch.Tensor]:
        ids, pos, slots, lens, rows = [], [], [], [], []
        visual_rows, embeds, deepstack = [], [], []
        start = 0
        for seq in seqs:
            n = len(seq)
            ids.extend(seq.all_ids)
            pos.append(self._positions(seq))
            slots.extend(self.blocks.slots(seq, 0, n))
            lens.append(n)
            rows.append(start + n - 1)
            if seq.visual is not None:
                image_rows = [start + j for j, t in enumerate(seq.prompt_ids) if t == self.model.cfg.image_token_id]
                visual_rows.extend(image_rows)
                embeds.append(seq.visual.embeds)
                if seq.visual.deepstack is not None:
                    deepstack.append(seq.visual.deepstack)
            start += n
        step = StepInputs(positions=torch.cat(pos, dim=1).to(self.device), slots=self._tensor(slots),
                          is_prefill=True, seq_lens=lens)
        if visual_rows:
            step.visual_rows = self._tensor(visual_rows)
            step.visual_embeds = torch.cat(embeds).to(self.device)
            if deepstack:
                step.deepstack = torch.cat(deepstack, dim=1).to(self.device)
        return self._tensor(ids), step, self._tensor(rows)

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
        """Host tensors of one decode step; block tables padded with block 0 (never read past a context)."""
        lens = [len(s) for s in seqs]
        width = max(len(s.block_table) for s in seqs)
        tables = torch.tensor([s.block_table + [0] * (width - len(s.block_table)) for s in seqs], dtype=torch.int32)
        ctx = torch.tensor(lens, dtype=torch.int32)
        bs = self.blocks.block_size
        newest = ctx.long() - 1
        return dict(input_ids=torch.tensor([s.last_token for s in seqs]),
                    positions=torch.tensor([n - 1 + s.rope_delta for s, n in zip(seqs, lens)]).expand(3, -1),
                    slots=tables.long().gather(1, (newest // bs)[:, None])[:, 0] * bs + newest % bs,
                    block_tables=tables, context_lens=ctx,
                    opt_out=torch.tensor([s.opt_out for s in seqs], dtype=torch.bool))

    def prepare_decode(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, StepInputs, torch.Tensor]:
        d = {k: v.to(self.device) for k, v in batch.items()}
        B = d["input_ids"].shape[0]
        step = StepInputs(positions=d["positions"], slots=d["slots"], is_prefill=False, seq_lens=[1] * B,
                          opt_out=d["opt_out"], block_tables=d["block_tables"], context_lens=d["context_lens"])
        return d["input_ids"], step, torch.arange(B, device=self.device)

    def run(self, seqs: list[Sequence], is_prefill: bool) -> list[int]:
        if is_prefill:
            ids, step, rows = self.prepare_prefill(seqs)
            return sample(self.model.forward(ids, step, self.kv, rows).logits, seqs)
        batch = self.decode_batch(seqs)
        if self.graphs is not None and len(seqs) <= self.graphs.max_batch:
            out = self.graphs.run(**batch)
        else:
            ids, step, rows = self.prepare_decode(batch)
            out = self.model.forward(ids, step, self.kv, rows)
        # Only the real rows count: a graph's bucket pads the batch with copies of row 0.
        self.routing_stats.add_step(out.routing, len(seqs), self.model.cfg.num_experts)
        return sample(out.logits, seqs)
