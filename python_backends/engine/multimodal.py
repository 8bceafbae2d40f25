"""Splicing kept visual tokens into a prompt: expanded ids, embeddings and mRoPE positions.

The prompt holds one `<|image_pad|>` per image; image i becomes K_i tokens (what VisionZip kept).
Kept tokens keep their original grid positions (t = start, h = start + row, w = start + col), and
text after an image continues as in the unpruned sequence: start + max(rows, cols) of the full grid.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class VisualInputs:
    embeds: torch.Tensor  # [V, hidden] kept visual tokens of all images, in prompt order
    deepstack: torch.Tensor | None  # [layers, V, hidden], added after the first decoder layers
    positions: torch.Tensor  # [3, prompt_len] mRoPE positions of the expanded prompt
    rope_delta: int  # decode position = token index + rope_delta

    def offload(self) -> None:
        """Moves the features off the GPU into pinned host memory once the prompt is in the KV cache:
        only a preemption's recompute reads them again, and decoding sequences would otherwise hold
        16 KiB of GPU memory per kept token (30B shape) outside the memory plan. The copy is queued
        on the stream (no wait); the GPU tensors may be freed at once, since later work on the same
        stream runs after it."""
        def host(t: torch.Tensor) -> torch.Tensor:
            return torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)

        if self.embeds.is_cuda:
            self.embeds = host(self.embeds)
            self.deepstack = None if self.deepstack is None else host(self.deepstack)


def splice_images(prompt_ids: list[int], image_token_id: int, counts: list[int], token_positions: torch.Tensor,
                  grids: list[tuple[int, int]]) -> tuple[list[int], torch.Tensor, int]:
    """prompt with one placeholder per image -> (expanded ids, positions [3, len], rope delta).

    counts[i]: kept tokens of image i; token_positions [sum(counts), 2]: (row, col) of each kept token;
    grids[i]: merged grid (rows, cols) of image i.
    """
    holes = [j for j, t in enumerate(prompt_ids) if t == image_token_id]
    if len(holes) != len(counts):
        raise ValueError(f"the prompt has {len(holes)} image placeholders for {len(counts)} images")
    ids: list[int] = []
    pos: list[torch.Tensor] = []
    current, prev, offset = 0, 0, 0
    for hole, k, (rows, cols) in zip(holes, counts, grids):
        text = hole - prev
        ids.extend(prompt_ids[prev:hole])
        pos.append(torch.arange(current, current + text).expand(3, -1))
        current += text
        rc = token_positions[offset:offset + k].long()
        pos.append(torch.stack([torch.full((k,), current), current + rc[:, 0], current + rc[:, 1]]))
        ids.extend([image_token_id] * k)
        current += max(rows, cols)
        offset += k
        prev = hole + 1
    tail = len(prompt_ids) - prev
    ids.extend(prompt_ids[prev:])
    pos.append(torch.arange(current, current + tail).expand(3, -1))
    positions = torch.cat(pos, dim=1)
    return ids, positions, int(positions.max()) + 1 - len(ids)
