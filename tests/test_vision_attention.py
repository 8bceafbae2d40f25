"""VisionEncoder's batched vision attention (one SDPA per image size per layer) against transformers'
own vision tower, run unmodified with its per-image attention."""
from __future__ import annotations

import pytest
import torch
from transformers import Qwen3VLMoeForConditionalGeneration
from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import apply_rotary_pos_emb_vision

from zipmoe.kernels.attention_importance import patch_importance_reference
from zipmoe.vision import VisionEncoder, attention_groups, patchify
from zipmoe.visionzip import merged_importance, weigh_images

from test_vision_reference import SIZES

MIXED = [SIZES[0], SIZES[1], SIZES[0], SIZES[2], SIZES[1], SIZES[0], SIZES[2]]  # equal sizes never adjacent
SAME = [(64, 64)] * 5


@pytest.fixture(scope="module")
def encoder(tiny_checkpoint):
    return VisionEncoder(tiny_checkpoint, torch.device("cpu"), torch.float32)


@pytest.fixture(scope="module")
def stock(tiny_checkpoint):
    """transformers' vision tower as transformers builds it (sdpa, one attention call per image)."""
    full = Qwen3VLMoeForConditionalGeneration.from_pretrained(tiny_checkpoint, dtype=torch.float32,
                                                              attn_implementation="sdpa")
    return full.model.visual.eval()


def reference_features(stock, images, layer=-1, unit=4):
    """What features() returns, from the stock tower, q and k recomputed by a hook on layer ℓ's input."""
    captured = {}

    def capture(attn, args, kwargs):
        x = args[0] if args else kwargs["hidden_states"]
        q, k, _ = attn.qkv(x).reshape(x.shape[0], 3, attn.num_heads, -1).permute(1, 0, 2, 3).unbind(0)
        q, k = apply_rotary_pos_emb_vision(q, k, *kwargs["position_embeddings"])
        captured.update(q=q, k=k, cu_seqlens=kwargs["cu_seqlens"], scale=attn.scaling)

    grids = torch.tensor([[1, im.shape[1] // 16, im.shape[2] // 16] for im in images])
    pixels = torch.cat([patchify(im, 16, 2, 2) for im in images])
    handle = stock.blocks[layer].attn.register_forward_pre_hook(capture, with_kwargs=True)
    try:
        with torch.no_grad():
            out = stock(pixels, grid_thw=grids, return_dict=True)
    finally:
        handle.remove()
    per_image = (grids.prod(-1) // unit).tolist()
    embeds = out.pooler_output.split(per_image)
    deepstack = torch.stack(out.deepstack_features).split(per_image, dim=1)
    importance = merged_importance(patch_importance_reference(
        captured["q"], captured["k"], captured["cu_seqlens"], captured["scale"]), unit)
    importance = weigh_images(importance, embeds, "distinct")
    keys = captured["k"].float().mean(1)
    keys = keys.reshape(-1, unit, keys.shape[-1]).mean(1).split(per_image)
    return embeds, deepstack, importance.split(per_image), keys


@pytest.mark.parametrize("sizes", [SAME, MIXED], ids=["one size", "mixed sizes"])
def test_matches_transformers_vision_tower(encoder, stock, sizes, monkeypatch):
    g = torch.Generator().manual_seed(1)
    images = [torch.randn(3, h, w, generator=g) for h, w in sizes]
    sdpa_calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        lambda *a, **kw: sdpa_calls.append(a[0].shape) or sdpa(*a, **kw))
    ours = encoder.features(images)
    # One call per distinct image size per layer, each over all images of that size.
    assert len(sdpa_calls) == len(encoder.model.blocks) * len(set(sizes))
    assert sorted(s[0] for s in sdpa_calls[:len(set(sizes))]) == sorted(sizes.count(s) for s in set(sizes))
    monkeypatch.undo()

    assert_features_close(ours, reference_features(stock, images), 1e-5)


def assert_features_close(ours, reference, tol: float) -> None:
    for i, f in enumerate(ours):
        for got, want in zip((f.embeds, f.deepstack, f.importance, f.keys), (part[i] for part in reference)):
            torch.testing.assert_close(got, want, atol=tol, rtol=tol)


def test_fused_norms_match_transformers(encoder, stock):
    """The tower's forward with the add + LayerNorm kernels (Triton's interpreter on the CPU; on
    CUDA they are the default) against the stock tower: float32 statistics in another order."""
    g = torch.Generator().manual_seed(3)
    images = [torch.randn(3, h, w, generator=g) for h, w in MIXED]
    encoder.fused_ops = True
    try:
        ours = encoder.features(images)
    finally:
        encoder.fused_ops = False
    assert_features_close(ours, reference_features(stock, images), 1e-4)


@pytest.mark.gpu
def test_cuda_fused_tower_matches_its_unfused_ops(tiny_checkpoint):
    """On CUDA in bf16 as served: the tower with the fused norms and the GELU epilogue against the
    same weights through transformers' own ops (fused_ops off); bf16 rounding apart, the same features."""
    encoder = VisionEncoder(tiny_checkpoint, torch.device("cuda"), torch.bfloat16)
    g = torch.Generator().manual_seed(4)
    images = [torch.randn(3, h, w, generator=g).cuda() for h, w in MIXED]
    fused = encoder.features(images)
    encoder.fused_ops = False
    plain = encoder.features(images)
    for f, p in zip(fused, plain):
        for got, want in ((f.embeds, p.embeds), (f.deepstack, p.deepstack)):
            torch.testing.assert_close(got.float(), want.float(), atol=5e-2, rtol=5e-2)


@pytest.mark.gpu
def test_cuda_gelu_epilogue_is_the_tanh_gelu():
    """_fc1_act's `torch._addmm_activation(..., use_gelu=True)` on CUDA applies the tanh GELU that
    Qwen3-VL's vision MLP uses (checked in float32, where the erf GELU is visibly different)."""
    g = torch.Generator().manual_seed(0)
    x, w, b = (torch.randn(*shape, generator=g).cuda() for shape in ((256, 1152), (4304, 1152), (4304,)))
    w = w / 1152 ** 0.5  # products of unit scale, where the two GELUs differ by up to ~5e-4
    fused = torch._addmm_activation(b, x, w.t(), use_gelu=True)
    product = torch.nn.functional.linear(x, w, b)
    torch.testing.assert_close(fused, torch.nn.functional.gelu(product, approximate="tanh"), atol=5e-5, rtol=1e-4)
    assert (fused - torch.nn.functional.gelu(product)).abs().max() > 2e-4


def test_attention_groups():
    one = attention_groups([4, 4, 4], torch.device("cpu"))
    assert one == [(4, slice(0, 12))]
    mixed = attention_groups([4, 2, 4, 2, 2, 1], torch.device("cpu"))
    assert [length for length, _ in mixed] == [4, 2, 1]
    assert mixed[0][1].tolist() == [0, 1, 2, 3, 6, 7, 8, 9]
    assert mixed[1][1].tolist() == [4, 5, 10, 11, 12, 13]
    assert mixed[2][1] == slice(14, 15)


def test_direct_model_call_matches_stock(encoder, stock):
    """Called without features() (no grouping prepared), the patched tower still matches."""
    sizes = MIXED[:4]
    g = torch.Generator().manual_seed(2)
    pixels = torch.cat([patchify(torch.randn(3, h, w, generator=g), 16, 2, 2) for h, w in sizes])
    grids = torch.tensor([[1, h // 16, w // 16] for h, w in sizes])
    with torch.no_grad():
        ours = encoder.model(pixels, grid_thw=grids, return_dict=True).pooler_output
        want = stock(pixels, grid_thw=grids, return_dict=True).pooler_output
    torch.testing.assert_close(ours, want, atol=1e-5, rtol=1e-5)


def test_patch_embedding_as_a_gemm_equals_the_conv3d(stock):
    """linear_patch_embed: the Conv3d with kernel = stride, run as one GEMM over patchify's rows."""
    import copy

    from zipmoe.vision import linear_patch_embed

    embed = copy.deepcopy(stock.patch_embed)
    x = torch.randn(37, embed.in_channels * embed.temporal_patch_size * embed.patch_size ** 2)
    reference = embed(x)
    linear_patch_embed(embed)
    torch.testing.assert_close(embed(x), reference, rtol=1e-5, atol=1e-5)


def test_grid_inputs_are_transformers_own_for_any_mix_of_sizes():
    """The per-grid cache gives, for a batch of images of any sizes in any order, exactly what
    transformers builds for the whole batch; a full cache forgets its oldest grid and stays right."""
    from transformers.vision_utils import (get_vision_cu_seqlens, get_vision_interpolation_indices_and_weights,
                                           get_vision_position_ids)

    from zipmoe.vision import GridInputs

    cache = GridInputs(48, 2, "bilinear", True, torch.device("cpu"), max_grids=2)
    for grids in ([(32, 32), (16, 24), (32, 32), (8, 40)], [(8, 40)], [(4, 4), (32, 32), (16, 24), (4, 4)]):
        thw = torch.tensor([[1, h, w] for h, w in grids])
        indices, weights = get_vision_interpolation_indices_and_weights(thw, 48, mode="bilinear", align_corners=True,
                                                                        spatial_merge_size=2)
        got = cache(grids)
        assert set(got) == {"cu_seqlens", "position_ids", "interp_indices", "interp_weights"}
        assert torch.equal(got["cu_seqlens"], get_vision_cu_seqlens(thw))
        assert torch.equal(got["position_ids"], get_vision_position_ids(thw, 2))
        assert torch.equal(got["interp_indices"], indices) and torch.equal(got["interp_weights"], weights)
        assert len(cache._cache) <= 2
