"""Per-request sampling on the device: greedy, or temperature -> top-k -> top-p with a per-request seeded generator."""
from __future__ import annotations

import torch

from .sequence import Sequence


def sample(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """logits [B, vocab] float32, one row per sequence -> next token ids [B] on the logits' device.

    Nothing is read back to the host, so a step can be followed by the next before its tokens are
    known (async scheduling, engine.py); each sampled row draws from its own sequence's generator.
    """
    out = logits.argmax(dim=-1)
    for i, seq in enumerate(seqs):
        p = seq.params
        if p.greedy:
            continue
        row = logits[i] / p.temperature
        if p.top_k > 0 and p.top_k < row.numel():
            kth = torch.topk(row, p.top_k).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        probs = torch.softmax(row, dim=-1)
        if p.top_p < 1.0:
            sorted_p, order = probs.sort(descending=True)
            # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
            drop = (sorted_p.cumsum(0) - sorted_p) >= p.top_p
            sorted_p[drop] = 0.0
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_p)
        # A categorical draw as argmax(p / Exp(1)) (multinomial's own method, without its checks,
        # which read values back to the host and would stall async scheduling).
        noise = torch.empty_like(probs).exponential_(generator=seq.generator)
        out[i] = (probs / noise).argmax()
    return out


def make_generator(seed: int | None, device: torch.device) -> torch.Generator:
    g = torch.Generator(device=device)
    if seed is None:
        g.seed()
    else:
        g.manual_seed(seed)
    return g
