"""Vision tower (transformers' own module, our weights) + global-budget VisionZip for N images.

The tower stays transformers' `Qwen3VLMoeVisionModel`, except its attention (`_attention`): one
batched SDPA per distinct image size per layer instead of transformers' one call per image; and its
patch embedding, a Conv3d with kernel = stride, runs as the equivalent GEMM (`linear_patch_embed`);
and on CUDA its rotary embedding of q and k is one Triton launch (`kernels.vision_rope`). The
attention of layer ℓ also hands over that layer's q and k, from which
`kernels.attention_importance.patch_importance` (a Triton kernel; its reference off CUDA) gets
how much attention each patch receives; each image then keeps its own most-attended tokens within
its share of one budget.
"""
from __future__ import annotations

from functools import partial
from itertools import accumulate
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from transformers import Qwen3VLMoeConfig
from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import Qwen3VLMoeVisionModel
from transformers.vision_utils import (
    get_vision_cu_seqlens,
    get_vision_interpolation_indices_and_weights,
    get_vision_position_ids,
)

from .checkpoint import open_weights
from .kernels.attention_importance import patch_importance, patch_importance_reference
from .kernels.layer_norm import add_layer_norm, add_layer_norm_reference, layer_norm, layer_norm_reference
from .kernels.vision_rope import vision_rope, vision_rope_reference
from .settings import make_current
from .visionzip import ImageFeatures, check_budget_weighting, merged_importance, weigh_images

VISUAL_PREFIX = "model.visual."


def patch_view(image: torch.Tensor, patch: int, merge: int, temporal: int) -> torch.Tensor:
    """CHW image -> a view [gh/m, gw/m, m, m, C, T, p, p] (no copy): patchify's rows before flattening."""
    c, h, w = image.shape
    gh, gw = h // patch, w // patch
    x = image.unsqueeze(0).expand(temporal, c, h, w)
    x = x.reshape(temporal, c, gh // merge, merge, patch, gw // merge, merge, patch)
    return x.permute(2, 5, 3, 6, 1, 0, 4, 7)


def patchify(image: torch.Tensor, patch: int, merge: int, temporal: int) -> torch.Tensor:
    """CHW image -> [grid_h*grid_w, C*temporal*patch*patch] in Qwen's flatten order (each merge x merge
    window's patches consecutive), the image repeated `temporal` times as transformers does."""
    c, h, w = image.shape
    return patch_view(image, patch, merge, temporal).reshape((h // patch) * (w // patch), c * temporal * patch * patch)


class GridInputs:
    """What the tower derives from each image's patch grid (position-embedding interpolation indices
    and weights, rotary position ids), kept on the device per grid: transformers builds them on the
    host for every request, about 7 ms of small CPU ops for 30 images of 1,024 patches plus their
    copies to the GPU, all before the first kernel. They depend on the grid alone, and an image's
    rows are the same whatever else is in the batch (tested), so a request's are one concatenation."""

    def __init__(self, num_grid_per_side: int, merge: int, mode: str, align_corners: bool, device: torch.device,
                 max_grids: int = 256):
        self._side, self._merge, self._mode, self._align = num_grid_per_side, merge, mode, align_corners
        self._device, self._max = device, max_grids
        self._cache: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def _one(self, grid: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if grid not in self._cache:
            if len(self._cache) >= self._max:  # many distinct sizes: forget the oldest
                del self._cache[next(iter(self._cache))]
            thw = torch.tensor([[1, *grid]])
            indices, weights = get_vision_interpolation_indices_and_weights(
                thw, self._side, mode=self._mode, align_corners=self._align, spatial_merge_size=self._merge)
            positions = get_vision_position_ids(thw, self._merge)
            self._cache[grid] = tuple(t.to(self._device) for t in (indices, weights, positions))
        return self._cache[grid]

    def __call__(self, grids: list[tuple[int, int]]) -> dict[str, torch.Tensor]:
        """Patch grids (h, w) of a batch's images -> the tower's precomputed keyword arguments."""
        parts = [self._one(g) for g in grids]
        thw = torch.tensor([[1, h, w] for h, w in grids])
        indices, weights, positions = (torch.cat(column) for column in zip(*parts))
        return dict(cu_seqlens=get_vision_cu_seqlens(thw).to(self._device), position_ids=positions,
                    interp_indices=indices, interp_weights=weights)


def pixels_of(image, mean: float | torch.Tensor = 0.5, std: float | torch.Tensor = 0.5) -> torch.Tensor:
    """A PIL image whose sides are already multiples of patch * merge -> normalised float32 CHW, as
    the image processor does when it needs no resize (Qwen-VL's mean and std are 0.5; per channel:
    [3, 1, 1] tensors)."""
    x = torch.from_numpy(np.asarray(image.convert("RGB"), dtype=np.float32)).permute(2, 0, 1) / 255.0
    return (x - mean) / std


def attention_groups(lengths: list[int], device: torch.device) -> list[tuple[int, slice | torch.Tensor]]:
    """Images (contiguous runs of patches, in order) grouped by patch count: (length, their rows), the
    rows a slice when the group is one run of consecutive images, else a gather index."""
    starts = list(accumulate(lengths, initial=0))
    groups = []
    for length in dict.fromkeys(lengths):  # distinct lengths, first-seen order
        members = [i for i, n in enumerate(lengths) if n == length]
        if members[-1] - members[0] == len(members) - 1:
            rows = slice(starts[members[0]], starts[members[-1]] + length)
        else:
            rows = torch.cat([torch.arange(starts[i], starts[i] + length) for i in members]).to(device)
        groups.append((length, rows))
    return groups


def linear_patch_embed(patch_embed: torch.nn.Module) -> None:
    """Run Qwen-VL's patch embedding, a Conv3d whose kernel equals its stride (each output reads
    exactly one patch), as the one GEMM it is: [patches, C*T*P*P] x [C*T*P*P, D], the patch
    flattened in the (C, T, P, P) order `patchify` lays it out. The same weights and math, without
    relying on the convolution library's choice of algorithm for a 3-D convolution on many patches."""
    weight = patch_embed.proj.weight  # [D, C, T, P, P]
    flat, bias = weight.reshape(weight.shape[0], -1), patch_embed.proj.bias

    def forward(hidden_states: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden_states.reshape(-1, flat.shape[1]).to(flat.dtype), flat, bias)

    patch_embed.forward = forward


class VisionEncoder:
    def __init__(self, checkpoint: str | Path, device: torch.device, dtype: torch.dtype, importance_layer: int = -1,
                 budget_weighting: str = "distinct", load_format: str = "auto"):
        self.budget_weighting = check_budget_weighting(budget_weighting)  # fails at load, not per request
        checkpoint = Path(checkpoint)
        config = Qwen3VLMoeConfig.from_pretrained(checkpoint)
        vcfg = config.vision_config
        vcfg._attn_implementation = "sdpa"
        self.patch, self.merge, self.temporal = vcfg.patch_size, vcfg.spatial_merge_size, vcfg.temporal_patch_size
        make_current(device)  # cuda:N: the thread that loads the tower makes its GPU current
        store = open_weights(checkpoint, load_format, device)
        with torch.device("meta"):
            model = Qwen3VLMoeVisionModel(vcfg)
        with store.reading("vision tower", (VISUAL_PREFIX,)):
            state = {name: store.get(VISUAL_PREFIX + name) for name, _ in model.named_parameters()}
        model.load_state_dict(state, assign=True)
        # Non-persistent buffers (rotary frequencies) were created on meta: rebuild them for real.
        model.rotary_pos_emb = type(model.rotary_pos_emb)(vcfg)
        self.model = model.to(device=device, dtype=dtype).eval()
        linear_patch_embed(self.model.patch_embed)
        self.device, self.dtype = device, dtype
        self._tanh_gelu = vcfg.hidden_act == "gelu_pytorch_tanh"  # what cuBLASLt's GELU epilogue computes
        self.fused_ops = device.type == "cuda"  # add + LayerNorm kernels, GELU epilogue (_tower)
        self._grid_inputs = GridInputs(model.num_grid_per_side, self.merge, model.interpolation_mode,
                                       model.interpolation_align_corners, device)
        self._importance_layer = importance_layer % vcfg.depth
        self._captured: dict[str, torch.Tensor] = {}
        self._groups: list[tuple[int, slice | torch.Tensor]] = []  # set by features() for one forward
        for layer, block in enumerate(self.model.blocks):
            block.attn.forward = partial(self._attention, block.attn, layer)

    def _attention(self, attn, layer: int, hidden_states: torch.Tensor, cu_seqlens: torch.Tensor,
                   position_embeddings: tuple[torch.Tensor, torch.Tensor], **kwargs) -> torch.Tensor:
        """transformers' Qwen3VLMoeVisionAttention with sdpa, batched: it runs one SDPA per image per
        layer (30 images x 27 layers = 810 small calls, plus a host sync per layer for the split
        sizes); here the images of one size share one call (one per layer for the usual request),
        with the grouping computed on the host once per forward (features()). Attention is full
        inside an image and never crosses images, so no mask. Layer ℓ also keeps its q and k (after
        rotary, [P, heads, d]) for the importance."""
        n, heads, d = hidden_states.shape[0], attn.num_heads, attn.head_dim
        q, k, v = attn.qkv(hidden_states).reshape(n, 3, heads, d).permute(1, 0, 2, 3).unbind(0)
        rope = vision_rope if q.is_cuda else vision_rope_reference  # one launch on CUDA, ~16 element-wise ops off it
        q, k = rope(q, k, *position_embeddings)
        if layer == self._importance_layer:
            self._captured.update(q=q, k=k, cu_seqlens=cu_seqlens, scale=attn.scaling)
        # Outside features() (the model called directly), group from cu_seqlens: one host sync per layer.
        groups = self._groups or attention_groups(cu_seqlens.diff().tolist(), q.device)
        out = None if len(groups) == 1 else torch.empty_like(v)
        for length, rows in groups:
            group = [x[rows].unflatten(0, (-1, length)).transpose(1, 2) for x in (q, k, v)]  # [B, heads, length, d]
            o = F.scaled_dot_product_attention(*group, scale=attn.scaling).transpose(1, 2).reshape(-1, heads, d)
            if out is None:
                out = o  # one group covers every patch in order: nothing to scatter
            else:
                out[rows] = o
        return attn.proj(out.reshape(n, -1))

    def _tower(self, pixels: torch.Tensor, pre: dict[str, torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """transformers' Qwen3VLMoeVisionModel.forward (merged tokens and the DeepStack features),
        its blocks' element-wise work fused on CUDA: each residual add runs with the LayerNorm after
        it (a block's second add with the next block's first norm) and the MLP's GELU runs in its
        first GEMM's epilogue, so a block makes 2 element-wise passes over the stream instead of 5.
        With `fused_ops` False (off CUDA), transformers' own ops in its order; the tests also run the
        fused norms on the CPU, in Triton's interpreter (the GELU epilogue needs CUDA)."""
        m, blocks = self.model, self.model.blocks
        norm, add_norm = ((layer_norm, add_layer_norm) if self.fused_ops
                          else (layer_norm_reference, add_layer_norm_reference))
        h = m.patch_embed(pixels)
        h = h + (m.pos_embed(pre["interp_indices"]) * pre["interp_weights"][:, :, None]).sum(1).to(h.dtype)
        rotary = m.rotary_pos_emb(h, pre["position_ids"])
        first = blocks[0].norm1
        x = norm(h, first.weight, first.bias, first.eps)
        deepstack = []
        for i, block in enumerate(blocks):
            attended = block.attn(x, cu_seqlens=pre["cu_seqlens"], position_embeddings=rotary)
            h, x = add_norm(h, attended, block.norm2.weight, block.norm2.bias, block.norm2.eps)
            out = block.mlp.linear_fc2(self._fc1_act(block.mlp, x))
            if i + 1 < len(blocks):
                after = blocks[i + 1].norm1
                h, x = add_norm(h, out, after.weight, after.bias, after.eps)
            else:
                h = h + out
            if i in m.deepstack_visual_indexes:
                deepstack.append(m.deepstack_merger_list[m.deepstack_visual_indexes.index(i)](h))
        return m.merger(h), deepstack

    def _fc1_act(self, mlp, x: torch.Tensor) -> torch.Tensor:
        """act(fc1(x)); on CUDA with the tanh GELU (Qwen3-VL's) in cuBLASLt's GEMM epilogue, computed
        from the float32 accumulator instead of a second kernel over the rounded product. (Only on
        CUDA: torch's CPU `_addmm_activation` applies the erf GELU.)"""
        fc1 = mlp.linear_fc1
        if self.fused_ops and x.is_cuda and self._tanh_gelu:
            return torch._addmm_activation(fc1.bias, x, fc1.weight.t(), use_gelu=True)
        return mlp.act_fn(fc1(x))

    @torch.inference_mode()
    def features(self, images: list[torch.Tensor]) -> list[ImageFeatures]:
        """One vision forward for all images (normalised CHW, sides multiples of patch * merge)."""
        if not images:
            return []
        make_current(self.device)  # the patch_importance kernel launches on the calling thread's current GPU
        sizes = [(im.shape[1] // self.patch, im.shape[2] // self.patch) for im in images]
        # What transformers would derive from grid_thw (a per-image loop and host syncs), from the
        # per-grid cache and handed over through its precompute kwargs.
        precomputed = self._grid_inputs(sizes)
        groups = attention_groups([h * w for h, w in sizes], self.device)  # read by _attention in every layer
        # Each image's patch rows written straight into one bf16 buffer: a copy-and-cast per image.
        width = 3 * self.temporal * self.patch * self.patch
        pixels = torch.empty(sum(h * w for h, w in sizes), width, dtype=self.dtype, device=self.device)
        start = 0
        for im, (h, w) in zip(images, sizes):
            view = patch_view(im.to(self.device), self.patch, self.merge, self.temporal)
            pixels[start:start + h * w].view(view.shape).copy_(view)
            start += h * w
        self._groups = groups
        try:
            pooled, deepstack = self._tower(pixels, precomputed)
        finally:
            self._groups = []
        unit = self.merge * self.merge
        per_image = [h * w // unit for h, w in sizes]
        embeds = pooled.split(per_image)
        deepstack = torch.stack(deepstack).split(per_image, dim=1)  # each [L, N_i, D]
        c, self._captured = self._captured, {}  # do not keep the batch's q/k alive until the next call
        importance_fn = patch_importance if c["q"].is_cuda else patch_importance_reference  # never an N_i x N_i matrix
        importance = merged_importance(importance_fn(c["q"], c["k"], c["cu_seqlens"], c["scale"]), unit)
        importance = weigh_images(importance, embeds, self.budget_weighting)  # how images share the budget
        keys = c["k"].float().mean(1)  # [P, d]: head-averaged keys ...
        keys = keys.reshape(-1, unit, keys.shape[-1]).mean(1)  # ... averaged over each merged token's patches
        # Token selection is small and branchy: it runs on the host, one copy of [N] + [N, d] values.
        importance, keys = importance.cpu().split(per_image), keys.cpu().split(per_image)
        return [ImageFeatures(embeds[i], deepstack[i], importance[i], keys[i],
                              (sizes[i][0] // self.merge, sizes[i][1] // self.merge))
                for i in range(len(images))]
