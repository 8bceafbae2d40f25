"""Interleaved multimodal RoPE (Qwen3-VL): frequency i rotates by the t, h or w position.

Frequencies are assigned round-robin t,h,w,t,h,w,... for the first 3*section[1] (h) and
3*section[2] (w) slots; all others use t. Text tokens have t = h = w, which makes this
plain 1-D RoPE for them. The decoder computes each step's cos/sin from these in its first launch
(`kernels/embed_rope.py`).
"""
from __future__ import annotations

import torch


class MRope:
    def __init__(self, head_dim: int, theta: float, section: tuple[int, int, int], device: torch.device):
        half = head_dim // 2
        if sum(section) != half:
            raise ValueError(f"mrope_section {section} must sum to head_dim/2 = {half}")
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim))
        axis = torch.zeros(half, dtype=torch.long)
        for a in (1, 2):
            idx = torch.arange(a, 3 * section[a], 3)
            axis[idx] = a
        self.axis = axis.to(device)  # [half]: which of (t, h, w) drives frequency i

