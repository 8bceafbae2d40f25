"""Vision-side helpers for `build/train_v2.py`: images of many sizes, pixels as uint8, per-token reading.

train_tiny's shortcuts assume one image size (one batched SDPA, one grid of rotary positions, a
reading head over a fixed number of tokens). Task set v2 (`build/taskset_v2.py`) draws images of
448..896 px a side, so here:
  - `packed_image_attention`: on CUDA in bf16/fp16, one variable-length flash attention call per
    layer over the packed images (`torch.nn.attention.varlen`); elsewhere one SDPA per distinct
    image length (the serving tower's grouping, `zipmoe.vision.attention_groups`). Either replaces
    transformers' loop over images. The grouped path cost the H200 ~33 groups a layer (a gather,
    an SDPA and a scatter each, forward and backward): most of a training step's 12.5 k launches;
  - `grid_cached_vision_inputs`: the tower's per-grid inputs from `zipmoe.vision.GridInputs`' cache;
  - `uint8_patches` (in the DataLoader workers) and `device_pixels` (on the training device): the
    workers ship patchified uint8 pixels without the temporal copy (an eighth of the float32
    bytes), and the device normalises and duplicates them, which gives exactly
    `patchify(pixels_of(image), patch, merge, temporal)` (tested);
  - `TokenReadingHead` with labels from `token_readings`: each merged visual token learns which
    characters (task set v2's `Mark`s) lie in its 32 x 32 pixel block, reports the visual tokens'
    scale and common mode (`common_mode_share`) for validation, and can keep that common mode small
    (`centering`; train_v2 sets it to 1). Training only, not saved.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from zipmoe.build.taskset_v2_docs import CHARSET, Mark
from zipmoe.build.training import MergedTokensHead
from zipmoe.vision import GridInputs, attention_groups, patchify

READING_SLOTS = 4  # characters a 32-px block holds at the fonts used (18-24 px text; 36-44 px prices)
END = len(CHARSET)  # class after a block's last character (or alone: the block shows no text)
READING_CLASSES = len(CHARSET) + 1
IGNORE = -100  # cross_entropy's ignore_index: slots after END

# transformers hands the vision attention packed images and their cu_seqlens only for attention
# names containing "flash" (the varlen path); the rest of the name says what runs.
PACKED_IMAGE_ATTENTION = "flash_packed_images"

try:  # torch >= 2.10 on CUDA: flash attention over packed sequences, with backward
    from torch.nn.attention.varlen import varlen_attn
except ImportError:  # pragma: no cover - older torch: the grouped path everywhere
    varlen_attn = None


def varlen_applies(query: torch.Tensor, dropout: float) -> bool:
    return (varlen_attn is not None and query.is_cuda and query.dtype in (torch.float16, torch.bfloat16)
            and dropout == 0.0)


def grouped_image_attention(query, key, value, lengths: list[int], scaling=None, dropout=0.0) -> torch.Tensor:
    """query/key/value [1, heads, N, dim] packing images of `lengths` -> [N, heads, dim]. Images of
    one length (wherever they are in the batch) share one SDPA call."""
    heads, n_tokens, dim = query.shape[1:]
    out = query.new_empty(n_tokens, heads, dim)
    for length, rows in attention_groups(lengths, query.device):
        q, k, v = (t[0][:, rows].view(heads, -1, length, dim).transpose(0, 1) for t in (query, key, value))
        o = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, scale=scaling)  # [images, heads, L, dim]
        out[rows] = o.permute(0, 2, 1, 3).reshape(-1, heads, dim)
    return out


def packed_image_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                           cu_seq_lens_q=None, max_length_q=None, **kwargs):
    """The tower's attention interface: query/key/value [1, heads, N, dim] packing images of any
    lengths (cu_seq_lens_q) -> ([1, N, heads, dim], None)."""
    if varlen_applies(query, dropout):
        q, k, v = (t[0].transpose(0, 1).contiguous() for t in (query, key, value))  # [N, heads, dim]
        cu = cu_seq_lens_q.to(torch.int32)
        longest = int(max_length_q) if max_length_q is not None else int((cu[1:] - cu[:-1]).max())
        return varlen_attn(q, k, v, cu, cu, longest, longest, scale=scaling).unsqueeze(0), None
    lengths = (cu_seq_lens_q[1:] - cu_seq_lens_q[:-1]).tolist()
    return grouped_image_attention(query, key, value, lengths, scaling, dropout).unsqueeze(0), None


AttentionInterface.register(PACKED_IMAGE_ATTENTION, packed_image_attention)


def grid_cached_vision_inputs(visual) -> None:
    """Hand the vision tower its per-grid inputs (rotary positions, position-embedding interpolation)
    from the serving tower's device cache, `zipmoe.vision.GridInputs` (the tower's helpers build them
    image by image, ~10 small ops each, every step). Grids with more than one frame: the helpers."""
    caches: dict = {}  # device -> GridInputs

    def hook(module, args, kwargs):
        grid_thw = kwargs["grid_thw"] if "grid_thw" in kwargs else args[1]
        grids = grid_thw.tolist()
        if any(t != 1 for t, _, _ in grids):
            return args, kwargs
        device = grid_thw.device
        if device not in caches:
            caches[device] = GridInputs(module.num_grid_per_side, module.spatial_merge_size, module.interpolation_mode,
                                        module.interpolation_align_corners, device)
        inputs = caches[device]([(h, w) for _, h, w in grids])
        kwargs.update({name: inputs[name] for name in ("position_ids", "interp_indices", "interp_weights")})
        return args, kwargs

    visual.register_forward_pre_hook(hook, with_kwargs=True)


def uint8_patches(image, patch: int, merge: int) -> torch.Tensor:
    """PIL image (sides multiples of patch * merge) -> [patches, 3 * patch * patch] uint8 in Qwen's
    patch order, one temporal copy (device_pixels adds the second)."""
    x = torch.from_numpy(np.asarray(image.convert("RGB"), dtype=np.uint8).copy()).permute(2, 0, 1)
    return patchify(x, patch, merge, 1)


def device_pixels(patches: torch.Tensor, temporal: int, mean: float = 0.5, std: float = 0.5) -> torch.Tensor:
    """uint8_patches (any device) -> float32 [patches, 3 * temporal * patch * patch], normalised as
    `pixels_of` does (Qwen-VL's mean and std, 0.5 for every channel) and repeated over time as
    transformers does for still images."""
    n, width = patches.shape
    x = (patches.float() / 255.0 - mean) / std
    return x.view(n, 3, 1, width // 3).expand(n, 3, temporal, width // 3).reshape(n, 3 * temporal * (width // 3))


def token_readings(marks: tuple[Mark, ...], size: tuple[int, int], block: int = 32) -> torch.Tensor:
    """Per merged token (raster order over the (H/block, W/block) grid), the characters whose ink
    centre lies in its block, left to right: [tokens, READING_SLOTS] class ids, END after the last
    one (a block without text is [END, IGNORE, ...]) and IGNORE after END; a block with more than
    READING_SLOTS characters keeps its first ones."""
    cols, rows = size[0] // block, size[1] // block
    cells: dict[int, list[tuple[float, str]]] = {}
    for m in marks:
        r, c = min(rows - 1, max(0, int(m.y // block))), min(cols - 1, max(0, int(m.x // block)))
        cells.setdefault(r * cols + c, []).append((m.x, m.char))
    labels = torch.full((rows * cols, READING_SLOTS), IGNORE, dtype=torch.long)
    labels[:, 0] = END
    for cell, chars in cells.items():
        ids = [CHARSET.index(ch) for _, ch in sorted(chars)][:READING_SLOTS]
        labels[cell, :len(ids)] = torch.tensor(ids)
        if len(ids) < READING_SLOTS:
            labels[cell, len(ids)] = END
    return labels


def common_mode_share(tokens: torch.Tensor) -> torch.Tensor:
    """[tokens, width] -> the share of their mean energy that lies in their mean vector (0: centred,
    1: every token the same vector)."""
    t = tokens.float()
    return t.mean(0).square().sum() / t.square().sum(-1).mean().clamp_min(1e-12)


class TokenReadingHead(MergedTokensHead):
    """Training-only auxiliary head: each merged visual token -> the characters in its block.

    train_tiny's ReadingHead (one image's digits from all its tokens) made the notes tower read;
    images of any size need a per-token target, and a dense one: every block of every image says
    what it shows, so the tower learns to read before the decoder learns where to look.

    centering (0 here: off; train_v2's default is 1): weight of a penalty on the visual tokens' common mode
    (`common_mode_share` of the merged tokens and of each DeepStack feature, above
    COMMON_MODE_ALLOWANCE). The merger's GELU feeds its last linear layer mostly positive
    activations, so the tower's tokens share one large mean vector (85 % of their energy at
    initialisation, 80 % still after 187 steps of training); this head reads them through a linear
    layer with a bias, blind to that vector, while the decoder sees each token through RMSNorm and
    per-head q/k norms, where a shared vector makes image keys and values alike. The trained notes
    tower keeps ~19 % there: the allowance. Session 16's run with weight 1 held the share at 0.12-0.20,
    and its decoder still did not read (docs/QUALITY.md): not enough alone."""

    COMMON_MODE_ALLOWANCE = 0.25

    def __init__(self, visual: torch.nn.Module, width: int, centering: float = 0.0):
        super().__init__(visual)
        self.linear = torch.nn.Linear(width, READING_SLOTS * READING_CLASSES)
        self.centering = centering

    def visual_features(self) -> list[torch.Tensor]:
        return [self.merged, *self.deepstack]

    def loss(self, readings: torch.Tensor) -> torch.Tensor:
        """readings [merged tokens of the batch, READING_SLOTS] -> mean cross-entropy of the labelled
        slots, plus the centering penalty (if on)."""
        logits = self.linear(self.merged.float()).view(-1, READING_CLASSES)
        loss = F.cross_entropy(logits, readings.view(-1), ignore_index=IGNORE)
        return loss + self.centering * self.common_mode_penalty() if self.centering else loss

    def common_mode_penalty(self) -> torch.Tensor:
        """Sum over the visual features of their common-mode share above the allowance."""
        return sum(F.relu(common_mode_share(f) - self.COMMON_MODE_ALLOWANCE) for f in self.visual_features())

    def visual_stats(self) -> dict:
        """Of the last forward's merged tokens and DeepStack features (in that order): mean token norm
        and `common_mode_share`."""
        with torch.no_grad():
            return {"token_norm": [round(float(f.float().norm(dim=-1).mean()), 3) for f in self.visual_features()],
                    "common_mode": [round(float(common_mode_share(f)), 4) for f in self.visual_features()]}
