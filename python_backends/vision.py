"""Vision tower (transformers' own module, our weights) + global-budget VisionZip for N images.

The tower is not the hot loop, so it stays transformers' `Qwen3VLMoeVisionModel`. A hook on the
attention of layer ℓ recomputes that layer's q and k, from which
`kernels.attention_importance.patch_importance` (a Triton kernel; its reference off CUDA) gets
how much attention each patch receives; the merged tokens then compete for one budget.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from transformers import Qwen3VLMoeConfig
from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import (
    Qwen3VLMoeVisionModel,
    apply_rotary_pos_emb_vision,
)

from .checkpoint import open_weights
from .kernels.attention_importance import patch_importance, patch_importance_reference
from .visionzip import ImageFeatures, check_budget_weighting, merged_importance, weigh_images

VISUAL_PREFIX = "model.visual."


def patchify(image: torch.Tensor, patch: int, merge: int, temporal: int) -> torch.Tensor:
    """CHW image -> [grid_h*grid_w, C*temporal*patch*patch] in Qwen's flatten order (each merge x merge
    window's patches consecutive), the image repeated `temporal` times as transformers does."""
    c, h, w = image.shape
    gh, gw = h // patch, w // patch
    x = image.unsqueeze(0).expand(temporal, c, h, w)
    x = x.reshape(temporal, c, gh // merge, merge, patch, gw // merge, merge, patch)
    x = x.permute(2, 5, 3, 6, 1, 0, 4, 7)  # gh/m, gw/m, m, m, C, T, p, p
    return x.reshape(gh * gw, c * temporal * patch * patch)


def pixels_of(image, mean: float | torch.Tensor = 0.5, std: float | torch.Tensor = 0.5) -> torch.Tensor:
    """A PIL image whose sides are already multiples of patch * merge -> normalised float32 CHW, as
    the image processor does when it needs no resize (Qwen-VL's mean and std are 0.5; per channel:
    [3, 1, 1] tensors)."""
    x = torch.from_numpy(np.asarray(image.convert("RGB"), dtype=np.float32)).permute(2, 0, 1) / 255.0
    return (x - mean) / std


class VisionEncoder:
    def __init__(self, checkpoint: str | Path, device: torch.device, dtype: torch.dtype, importance_layer: int = -1,
                 budget_weighting: str = "distinct", load_format: str = "auto"):
        self.budget_weighting = check_budget_weighting(budget_weighting)  # fails at load, not per request
        checkpoint = Path(checkpoint)
        config = Qwen3VLMoeConfig.from_pretrained(checkpoint)
        vcfg = config.vision_config
        vcfg._attn_implementation = "sdpa"
        self.patch, self.merge, self.temporal = vcfg.patch_size, vcfg.spatial_merge_size, vcfg.temporal_patch_size
        store = open_weights(checkpoint, load_format, device)
        with torch.device("meta"):
            model = Qwen3VLMoeVisionModel(vcfg)
        with store.reading("vision tower", (VISUAL_PREFIX,)):
            state = {name: store.get(VISUAL_PREFIX + name) for name, _ in model.named_parameters()}
        model.load_state_dict(state, assign=True)
        # Non-persistent buffers (rotary frequencies) were created on meta: rebuild them for real.
        model.rotary_pos_emb = type(model.rotary_pos_emb)(vcfg)
        self.model = model.to(device=device, dtype=dtype).eval()
        self.device, self.dtype = device, dtype
        layer = importance_layer % vcfg.depth
        self._captured: dict[str, torch.Tensor] = {}
        self.model.blocks[layer].attn.register_forward_pre_hook(self._capture_qk, with_kwargs=True)

    def _capture_qk(self, attn, args, kwargs):
        """Recomputes q, k of the importance layer from its input (the attention output itself is unchanged)."""
        x = args[0] if args else kwargs["hidden_states"]
        n = x.shape[0]
        q, k, _ = attn.qkv(x).reshape(n, 3, attn.num_heads, -1).permute(1, 0, 2, 3).unbind(0)
        cos, sin = kwargs["position_embeddings"]
        q, k = apply_rotary_pos_emb_vision(q, k, cos, sin)
        self._captured.update(q=q, k=k, cu_seqlens=kwargs["cu_seqlens"], scale=attn.scaling)

    @torch.inference_mode()
    def features(self, images: list[torch.Tensor]) -> list[ImageFeatures]:
        """One vision forward for all images (normalised CHW, sides multiples of patch * merge)."""
        if not images:
            return []
        grids = torch.tensor([[1, im.shape[1] // self.patch, im.shape[2] // self.patch] for im in images])
        pixels = torch.cat([patchify(im.to(self.device, torch.float32), self.patch, self.merge, self.temporal)
                            for im in images]).to(self.dtype)
        out = self.model(pixels, grid_thw=grids.to(self.device), return_dict=True)
        unit = self.merge * self.merge
        per_image = (grids.prod(-1) // unit).tolist()
        embeds = out.pooler_output.split(per_image)
        deepstack = torch.stack(out.deepstack_features).split(per_image, dim=1)  # each [L, N_i, D]
        c, self._captured = self._captured, {}  # do not keep the batch's q/k alive until the next call
        importance_fn = patch_importance if c["q"].is_cuda else patch_importance_reference  # never an N_i x N_i matrix
        importance = merged_importance(importance_fn(c["q"], c["k"], c["cu_seqlens"], c["scale"]), unit)
        importance = weigh_images(importance, embeds, self.budget_weighting)  # how images share the budget
        keys = c["k"].float().mean(1)  # [P, d]: head-averaged keys ...
        keys = keys.reshape(-1, unit, keys.shape[-1]).mean(1)  # ... averaged over each merged token's patches
        # Token selection is small and branchy: it runs on the host, one copy of [N] + [N, d] values.
        importance, keys = importance.cpu().split(per_image), keys.cpu().split(per_image)
        return [ImageFeatures(embeds[i], deepstack[i], importance[i], keys[i],
                              (int(grids[i, 1]) // self.merge, int(grids[i, 2]) // self.merge))
                for i in range(len(images))]
