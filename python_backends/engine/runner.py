"""Turns a scheduled batch into model inputs, runs one forward and samples one token per sequence."""
from __future__ import annotations

import torch

from .kv_cache import BlockManager, KVCache
from .model import Qwen3VLMoeTextDecoder, StepInputs
from .sampler import sample
from .sequence import Sequence


class ModelRunner:
    def __init__(self, model: Qwen3VLMoeTextDecoder, kv: KVCache, blocks: BlockManager):
        self.model = model
        self.kv = kv
        self.blocks = blocks
        self.device = model.device

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

    def prepare_decode(self, seqs: list[Sequence]) -> tuple[torch.Tensor, StepInputs, torch.Tensor]:
        bs = self.blocks.block_size
        lens = [len(s) for s in seqs]
        max_len, max_blocks = max(lens), max(len(s.block_table) for s in seqs)
        # Each context's cache slots, expanded on the device from the padded block tables (O(blocks) host work).
        tables = self._tensor([s.block_table + [0] * (max_blocks - len(s.block_table)) for s in seqs])
        gather = (tables[:, :, None] * bs + torch.arange(bs, device=self.device)).flatten(1)[:, :max_len]
        ctx = self._tensor(lens)
        step = StepInputs(
            positions=self._tensor([n - 1 + s.rope_delta for s, n in zip(seqs, lens)]).expand(3, -1),
            slots=gather.gather(1, (ctx - 1)[:, None])[:, 0],  # where the newest token's K/V goes
            is_prefill=False, seq_lens=[1] * len(seqs), gather_slots=gather,
            attn_mask=(torch.arange(max_len, device=self.device)[None, :] < ctx[:, None])[:, None, None, :],
            opt_out=self._tensor([s.opt_out for s in seqs], torch.bool))
        return self._tensor([s.last_token for s in seqs]), step, torch.arange(len(seqs), device=self.device)

    def run(self, seqs: list[Sequence], is_prefill: bool) -> list[int]:
        ids, step, rows = (self.prepare_prefill if is_prefill else self.prepare_decode)(seqs)
        logits = self.model.forward(ids, step, self.kv, rows)
        return sample(logits, seqs)
