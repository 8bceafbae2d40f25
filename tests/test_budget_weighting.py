"""How a request's images share the VisionZip budget, on the trained checkpoint and real notes:
by distinct tokens (the default), detail-dense notes keep more tokens than plain ones, and the
shares of issue 16's 640 x 480 pair never flip as keep goes down."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw, ImageFont
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

from zipmoe.serve import TRAINED_CHECKPOINT
from zipmoe.build import notes_data
from zipmoe.image_pipeline import ImageConfig
from zipmoe.vision import VisionEncoder, pixels_of
from zipmoe.visionzip import compress, distinct_token_count

N_EXAMPLES = 24


@pytest.fixture(scope="module")
def requests():
    return [ex for ex in notes_data.examples("test", N_EXAMPLES) if {"dense", "plain"} <= set(ex.kinds)]


def kept_by_kind(encoder: VisionEncoder, requests, keep: float) -> dict[str, float]:
    kept = {"dense": [], "plain": []}
    for ex in requests:
        for kind, tokens in zip(ex.kinds, compress(encoder.features([pixels_of(im) for im in ex.images]), keep)):
            kept[kind].append(tokens.embeds.shape[0])
    return {kind: float(np.mean(v)) for kind, v in kept.items()}


def test_dense_notes_keep_more_tokens_by_distinct_tokens(requests):
    encoder = VisionEncoder(TRAINED_CHECKPOINT, torch.device("cpu"), torch.float32)
    assert encoder.budget_weighting == "distinct"
    kept = kept_by_kind(encoder, requests, 0.5)
    assert kept["dense"] >= 1.3 * kept["plain"]
    # Every image still keeps its floor, and the budget is the request's: 0.5 of all tokens.
    for ex in requests[:4]:
        tokens = compress(encoder.features([pixels_of(im) for im in ex.images]), 0.5)
        assert min(t.embeds.shape[0] for t in tokens) >= 4
        assert sum(t.embeds.shape[0] for t in tokens) == round(0.5 * 16 * len(ex.images))


def test_importance_mass_per_image(requests):
    """size: each image's merged importance sums to its patch count; distinct: to merge x its
    distinct-token count, the same attention otherwise."""
    images = [pixels_of(im) for im in requests[0].images]
    by_size = VisionEncoder(TRAINED_CHECKPOINT, torch.device("cpu"), torch.float32, budget_weighting="size").features(images)
    distinct = VisionEncoder(TRAINED_CHECKPOINT, torch.device("cpu"), torch.float32).features(images)
    for a, b in zip(by_size, distinct):
        assert a.importance.sum().item() == pytest.approx(64.0, rel=1e-4)  # 8 x 8 patches, 1.0 each on average
        share = distinct_token_count(a.embeds) / a.embeds.shape[0]
        assert torch.allclose(b.importance, a.importance * share, rtol=1e-5)


def test_unknown_weighting_fails_at_load():
    with pytest.raises(ValueError, match="budget weighting"):
        VisionEncoder(TRAINED_CHECKPOINT, torch.device("cpu"), torch.float32, budget_weighting="area")


def issue_pair(lines: int = 14) -> list[Image.Image]:
    """Issue 16's request: 640 x 480 lines of receipt text, and a plain ellipse on a flat background,
    resized as the checkpoint's image processor does (576 x 416: 234 tokens each)."""
    receipt = Image.new("RGB", (640, 480), (250, 250, 248))
    draw, font = ImageDraw.Draw(receipt), ImageFont.load_default(size=16)
    for k in range(lines):
        y = 20 + k * 440 / lines
        draw.text((20, y), f"ITEM {chr(65 + k)}{k:02d}", font=font, fill=(20, 20, 30))
        draw.text((620, y), f"{(k * 37) % 90 + 1}.{(k * 13) % 100:02d}", font=font, fill=(20, 20, 30), anchor="ra")
    ellipse = Image.new("RGB", (640, 480), (235, 235, 235))
    ImageDraw.Draw(ellipse).ellipse((160, 120, 480, 360), fill=(200, 40, 40))
    cfg = ImageConfig.from_checkpoint(TRAINED_CHECKPOINT)
    height, width = smart_resize(480, 640, cfg.factor, cfg.min_pixels, cfg.max_pixels)
    return [im.resize((width, height), Image.BICUBIC) for im in (receipt, ellipse)]


def test_issue_pair_shares_never_flip():
    """Before, the global top-k kept 176 / 105 tokens at keep 0.6 but 66 / 74 at 0.3."""
    features = VisionEncoder(TRAINED_CHECKPOINT, torch.device("cpu"), torch.float32).features(
        [pixels_of(im) for im in issue_pair()])
    assert [f.embeds.shape[0] for f in features] == [234, 234]
    assert features[0].importance.sum() > features[1].importance.sum()  # the text has more distinct tokens
    kept = [[t.embeds.shape[0] for t in compress(features, k / 10)] for k in range(2, 10)]
    assert all(text >= plain for text, plain in kept)
    assert kept[1][0] > kept[1][1] and kept[4][0] > kept[4][1]  # at 0.3 as at 0.6
    assert all(a <= b for low, high in zip(kept, kept[1:]) for a, b in zip(low, high))


def test_a_sparse_receipt_still_counts_more_distinct_tokens_than_the_ellipse():
    """8 lines spread over mostly blank paper: the uncentred participation ratio counted 1.57
    distinct tokens for them against the ellipse's 1.69 (its common component rules it), so the
    ellipse kept more at every keep; the entropy count puts the text ahead (3.0 against 2.4)."""
    features = VisionEncoder(TRAINED_CHECKPOINT, torch.device("cpu"), torch.float32).features(
        [pixels_of(im) for im in issue_pair(lines=8)])
    text, ellipse = (distinct_token_count(f.embeds).item() for f in features)
    assert text > 1.1 * ellipse
    kept = [[t.embeds.shape[0] for t in compress(features, k / 10)] for k in range(2, 10)]
    assert all(text >= plain for text, plain in kept)
