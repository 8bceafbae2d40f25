"""How a request's images share the VisionZip budget, on the trained checkpoint and real notes:
by distinct tokens (the default), detail-dense notes keep more tokens than plain ones."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from zipmoe.serve import TRAINED_CHECKPOINT
from zipmoe.build import notes_data
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
