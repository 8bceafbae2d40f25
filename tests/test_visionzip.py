"""VisionZip with one budget per request: importance, budget, shares by weight, floors, folding."""
import math

import pytest
import torch
import torch.nn.functional as F

from zipmoe.kernels.attention_importance import patch_importance_reference
from zipmoe.visionzip import (apply_selection, apportion, distinct_token_count, merged_importance, select_tokens,
                              weigh_images)

# Repeated sizes go through select_tokens' batched pass together (one per size).
MIXES = [[16], [16, 64, 100, 256], [3, 64], [16, 64, 101], [7, 5, 9], [64, 64, 64], [16, 64, 16, 64, 5]]
RATIOS = [0.01, 0.1, 0.25, 1 / 3, 0.5, 0.7, 0.95, 1.0]


def _random_request(sizes, seed=0, dk=8):
    g = torch.Generator().manual_seed(seed)
    return ([torch.rand(n, generator=g) for n in sizes], [torch.randn(n, dk, generator=g) for n in sizes])


def _expected_budget(sizes, ratio, min_per_image=4):
    floors = sum(min(n, min_per_image) for n in sizes)
    return min(sum(sizes), max(floors, math.floor(ratio * sum(sizes) + 0.5)))


def _webster(weights, total, caps):
    """apportion's spec, one unit at a time: the next unit goes to the highest w_i / (n_i + 1/2)
    below its cap, ties to the heavier item, then the earlier one."""
    counts = [0] * len(weights)
    for _ in range(total):
        best = max((i for i in range(len(weights)) if counts[i] < caps[i]),
                   key=lambda i: (weights[i] / (counts[i] + 0.5), weights[i], -i))
        counts[best] += 1
    return counts


def _expected_counts(importance, budget, min_per_image=4):
    """Floors, then the rest of the budget by Webster over each image's importance sum."""
    floors = [min(len(imp), min_per_image) for imp in importance]
    above = _webster([float(imp.double().sum()) for imp in importance], budget - sum(floors),
                     [len(imp) - f for imp, f in zip(importance, floors)])
    return [f + a for f, a in zip(floors, above)]


@pytest.mark.parametrize("sizes", MIXES)
@pytest.mark.parametrize("ratio", RATIOS)
def test_budget_is_met_exactly_and_selection_follows_the_spec(sizes, ratio):
    importance, keys = _random_request(sizes)
    sels = select_tokens(importance, keys, ratio)
    budget = _expected_budget(sizes, ratio)
    assert sum(len(s.kept) for s in sels) == budget

    counts = _expected_counts(importance, budget)
    assert [len(s.kept) for s in sels] == counts
    room = [min(k - min(len(imp), 4), len(imp) - k) for imp, k in zip(importance, counts)]
    n_context = 0 if budget == sum(sizes) else min(sum(room), math.floor(0.05 * budget + 0.5))
    assert sum(int(s.is_context.sum()) for s in sels) == n_context

    for s, imp, k, r in zip(sels, importance, keys, room):
        n = len(imp)
        assert len(s.kept) >= min(n, 4)  # floor
        assert int(s.is_context.sum()) <= r
        # The image's own top tokens by importance (ties: lower token) are its dominant ones.
        dominant = sorted(range(n), key=lambda j: (-imp[j].item(), j))[: len(s.kept) - int(s.is_context.sum())]
        assert s.kept[~s.is_context].tolist() == sorted(dominant)
        assert s.kept.dtype == torch.long and s.assign.dtype == torch.long
        assert torch.all(s.kept[1:] > s.kept[:-1])  # ascending, original order
        assert torch.equal(s.assign[s.kept], torch.arange(len(s.kept)))  # kept tokens map to themselves
        dropped = torch.ones(n, dtype=torch.bool)
        dropped[s.kept] = False
        targets = s.kept[s.is_context]
        if len(targets):
            # targets spread evenly over the non-dominant tokens; each dropped token joins its
            # most key-similar target
            rest = torch.cat([targets, dropped.nonzero().squeeze(1)]).sort().values
            assert torch.equal(targets, rest[torch.arange(len(targets)) * len(rest) // len(targets)])
            unit = F.normalize(k, dim=-1)
            best = (unit[dropped] @ unit[targets].T).argmax(1)
            assert torch.equal(s.kept[s.assign[dropped]], targets[best])
        else:
            assert torch.all(s.assign[dropped] == -1)


def test_a_request_of_thirty_same_size_images_follows_the_spec():
    """The served shape: 30 images of 256 tokens, keys of the vision head width, one batched pass."""
    importance, keys = _random_request([256] * 30, seed=3, dk=72)
    for ratio in (0.4, 0.6):
        sels = select_tokens(importance, keys, ratio, context_fraction=0.05)
        assert sum(len(s.kept) for s in sels) == _expected_budget([256] * 30, ratio)
        for s, imp, k in zip(sels, importance, keys):
            dropped = torch.ones(256, dtype=torch.bool)
            dropped[s.kept] = False
            targets = s.kept[s.is_context]
            unit = F.normalize(k, dim=-1)
            assert torch.equal(s.kept[s.assign[dropped]], targets[(unit[dropped] @ unit[targets].T).argmax(1)])


def test_context_count_and_rounding():
    # N = 181, ratio 0.5 -> 90.5 rounds up to 91; C = round(0.05 * 91) = 5.
    sels = select_tokens(*_random_request([16, 64, 101]), 0.5)
    assert sum(len(s.kept) for s in sels) == 91
    assert sum(int(s.is_context.sum()) for s in sels) == 5
    # When the floors take the whole budget there is no room for context.
    sels = select_tokens(*_random_request([16, 64, 100, 256]), 0.01)
    assert [len(s.kept) for s in sels] == [4, 4, 4, 4]
    assert not any(s.is_context.any() for s in sels)


def test_keep_ratio_out_of_range():
    for bad in (0.0, -0.1, 1.01):
        with pytest.raises(ValueError):
            select_tokens(*_random_request([16]), bad)


def test_ties_are_broken_by_image_then_token():
    ones = [torch.ones(8), torch.ones(8)]
    keys = [torch.randn(8, 4), torch.randn(8, 4)]
    sels = select_tokens(ones, keys, 0.5, context_fraction=0.0, min_per_image=2)
    assert [s.kept.tolist() for s in sels] == [[0, 1, 2, 3], [0, 1, 2, 3]]  # equal weights, equal shares
    sels = select_tokens(ones, keys, 9 / 16, context_fraction=0.0, min_per_image=2)
    assert [s.kept.tolist() for s in sels] == [[0, 1, 2, 3, 4], [0, 1, 2, 3]]  # the odd token: first image


def test_apportion_follows_the_sequential_spec_and_is_house_monotone():
    g = torch.Generator().manual_seed(3)
    for trial in range(30):
        m = 1 + trial % 5
        weights = (torch.rand(m, generator=g) * 10).tolist()
        if trial % 3 == 0:
            weights[-1] = weights[0]  # a tie in weight
        caps = torch.randint(0, 12, (m,), generator=g).tolist()
        previous = [0] * m
        for total in range(sum(caps) + 1):
            counts = apportion(weights, total, caps)
            assert counts == _webster(weights, total, caps)
            assert all(p <= c <= cap for p, c, cap in zip(previous, counts, caps))
            previous = counts


def test_detail_image_gets_more_budget_handmade():
    detail = torch.full((64,), 0.1)
    detail[torch.arange(0, 64, 2)] = torch.linspace(5.0, 10.0, 32)  # many distinct hot tokens
    flat = torch.ones(64)
    sels = select_tokens([detail, flat], [torch.randn(64, 8), torch.randn(64, 8)], 0.3)
    assert len(sels[0].kept) > len(sels[1].kept)
    assert len(sels[0].kept) + len(sels[1].kept) == round(0.3 * 128)


def test_attention_picks_tokens_inside_an_image_not_its_share():
    """Image A: every query attends to a sparse pattern of half its merged tokens (text-like
    detail, a few of them much hotter); image B: uniform attention. One budget for both: as images
    of one size their unweighted importance sums to the same mass, so they get the same share
    (weigh_images is what moves it), and A keeps its detail tokens."""
    heads, d, side = 2, 8, 16
    n = side * side  # patches per image; merged tokens = n // 4
    scale = d ** -0.5
    hot = torch.arange(0, n // 4, 2)  # half of A's merged tokens carry detail
    logit = torch.zeros(n // 4)
    logit[hot] = 3.0
    logit[hot[:3]] = 4.0  # a few dominant hot spots
    logit = logit.repeat_interleave(4)  # the same for the 4 patches of each merged token
    e0 = F.one_hot(torch.tensor(0), d).float()
    q_a = e0.expand(n, heads, d)
    k_a = ((logit / scale)[:, None, None] * e0).expand(n, heads, d)  # q.k * scale == logit for every query and head
    q_b = torch.zeros(n, heads, d)  # all logits 0 -> uniform attention
    k_b = torch.randn(n, heads, d, generator=torch.Generator().manual_seed(0))
    cu = torch.tensor([0, n, 2 * n])
    imp = merged_importance(patch_importance_reference(torch.cat([q_a, q_b]), torch.cat([k_a, k_b]), cu, scale))
    imp_a, imp_b = imp[: n // 4], imp[n // 4:]
    assert torch.allclose(imp_b, torch.full_like(imp_b, 4.0))  # uniform: 1.0 per patch
    assert imp_a[hot].min() > 4.0 > imp_a[1::2].max()  # detail tokens above uniform, the rest below

    keys = list(torch.randn(2, n // 4, 8, generator=torch.Generator().manual_seed(1)))
    assert imp_a.sum().item() == pytest.approx(imp_b.sum().item(), rel=1e-5)
    sel_a, sel_b = select_tokens([imp_a, imp_b], keys, 0.6)
    assert abs(len(sel_a.kept) - len(sel_b.kept)) <= 1
    assert set(hot.tolist()) <= set(sel_a.kept[~sel_a.is_context].tolist())


def test_floor_holds_for_a_dull_image():
    importance = [torch.ones(64), torch.full((64,), 1e-6), torch.ones(64)]
    importance[1][[5, 17, 40, 63]] = 2e-6  # the dull image's own best four
    sels = select_tokens(importance, list(torch.randn(3, 64, 8)), 0.2)
    dull = sels[1]
    assert dull.kept[~dull.is_context].tolist() == [5, 17, 40, 63]
    assert sum(len(s.kept) for s in sels) == round(0.2 * 192)


def test_floor_larger_than_image():
    sels = select_tokens(*_random_request([2, 64]), 0.05, min_per_image=4)
    assert sels[0].kept.tolist() == [0, 1]
    assert len(sels[1].kept) >= 4


def test_apply_selection_embeddings_and_deepstack_agree():
    importance, keys = _random_request([100])
    sel = select_tokens(importance, keys, 0.3, context_fraction=0.2)[0]
    assert sel.is_context.any()
    layers = torch.randn(3, 100, 16)
    stacked = apply_selection(layers, sel)
    assert stacked.shape == (3, len(sel.kept), 16)
    for layer in range(3):
        flat = apply_selection(layers[layer], sel)
        assert torch.equal(stacked[layer], flat)
        for row, token in enumerate(sel.kept.tolist()):
            members = (sel.assign == row).nonzero().squeeze(1)
            if sel.is_context[row]:
                assert token in members.tolist() and len(members) > 1
                assert torch.allclose(flat[row], layers[layer, members].mean(0), atol=1e-6)
            else:
                assert members.tolist() == [token]
                assert torch.equal(flat[row], layers[layer, token])


def test_apply_selection_bf16_keeps_dominant_rows_exact():
    importance, keys = _random_request([64])
    sel = select_tokens(importance, keys, 0.5, context_fraction=0.2)[0]
    x = torch.randn(64, 8).bfloat16()
    out = apply_selection(x, sel)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out[~sel.is_context], x[sel.kept[~sel.is_context]])


def test_keep_all_is_identity():
    importance, keys = _random_request([16, 64])
    for sel, n in zip(select_tokens(importance, keys, 1.0), [16, 64]):
        assert torch.equal(sel.kept, torch.arange(n))
        assert torch.equal(sel.assign, torch.arange(n))
        assert not sel.is_context.any()
        x = torch.randn(2, n, 8)
        assert torch.equal(apply_selection(x, sel), x)


def test_merged_importance_sums_groups_of_four():
    assert merged_importance(torch.arange(8.0)).tolist() == [6.0, 22.0]
    with pytest.raises(ValueError):
        merged_importance(torch.ones(6))


def test_compress_equals_per_image_selection():
    """compress folds all images at once; it must equal selecting and folding image by image."""
    from zipmoe.visionzip import ImageFeatures, compress

    g = torch.Generator().manual_seed(5)
    grids = [(4, 6), (2, 2), (5, 3)]
    feats = [ImageFeatures(torch.randn(r * c, 8, generator=g), torch.randn(2, r * c, 8, generator=g),
                           torch.rand(r * c, generator=g), torch.randn(r * c, 4, generator=g), (r, c))
             for r, c in grids]
    out = compress(feats, 0.5, context_fraction=0.2, min_per_image=2)
    sels = select_tokens([f.importance for f in feats], [f.keys for f in feats], 0.5, 0.2, 2)
    for f, s, t in zip(feats, sels, out):
        torch.testing.assert_close(t.embeds, apply_selection(f.embeds, s))
        torch.testing.assert_close(t.deepstack, apply_selection(f.deepstack, s))
        assert t.positions.tolist() == [[int(k) // f.grid[1], int(k) % f.grid[1]] for k in s.kept]


# ------------------------------------------------------------------ budget weighting: distinct tokens

def test_distinct_token_count_bounds():
    assert distinct_token_count(torch.ones(16, 8) * 3.0).item() == pytest.approx(1.0)  # all one direction
    assert distinct_token_count(torch.eye(16) * 2.0).item() == pytest.approx(16.0)  # mutually orthogonal
    assert distinct_token_count(torch.eye(4).repeat(4, 1)).item() == pytest.approx(4.0)  # 4 directions, 4 times
    assert distinct_token_count(torch.zeros(8, 4)).item() == 1.0  # no direction at all: one token, not inf


def effective_rank(x: torch.Tensor) -> float:
    """exp of the entropy of the unit-normalised rows' Gram spectrum, by eigendecomposition."""
    unit = F.normalize(x.double(), dim=-1)
    eigenvalues = torch.linalg.eigvalsh(unit @ unit.T).clamp_min(0)
    p = eigenvalues / eigenvalues.sum()
    return torch.exp(-torch.special.xlogy(p, p).sum()).item()


@pytest.mark.parametrize("n, d", [(12, 40), (40, 12)])  # both sides of the Gram-matrix choice
def test_distinct_token_count_follows_its_definition(n, d):
    """c = |mean unit row|^2 and the centred rows' participation ratio P, from the centred Gram
    matrix's eigenvalues: D = exp(-c ln c - (1 - c) ln((1 - c) / P))."""
    x = torch.randn(n, d, generator=torch.Generator().manual_seed(n)) + 0.7  # a common component, as towers give
    unit = F.normalize(x.double(), dim=-1)
    mean = unit.mean(0)
    c = mean.square().sum()
    eigenvalues = torch.linalg.eigvalsh((unit - mean) @ (unit - mean).T)
    spread = eigenvalues.sum() ** 2 / eigenvalues.square().sum()
    want = torch.exp(-c * c.log() - (1 - c) * ((1 - c) / spread).log()).item()
    assert distinct_token_count(x.to(torch.bfloat16)).item() == pytest.approx(want, rel=2e-2)
    assert distinct_token_count(x).item() == pytest.approx(want, rel=1e-5)
    assert distinct_token_count(x.expand(3, n, d)).tolist() == pytest.approx([want] * 3, rel=1e-5)  # batched


@pytest.mark.parametrize("c", [0.3, 0.6, 0.9])
def test_distinct_token_count_is_the_effective_rank_when_the_variation_is_flat(c):
    """Tokens = a common direction (energy share c) + one of k orthogonal deviations, evenly: the
    Gram spectrum is then exactly one eigenvalue for the mean and k - 1 equal ones."""
    k, d = 6, 16
    axes = torch.eye(d)[1:k + 1]  # k orthogonal rows, all orthogonal to axis 0
    deviation = axes - axes.mean(0)  # still orthogonal to axis 0; they sum to 0
    deviation = F.normalize(deviation, dim=-1) * (1 - c) ** 0.5
    rows = (torch.eye(1, d) * c ** 0.5 + deviation).repeat(5, 1)
    assert distinct_token_count(rows).item() == pytest.approx(effective_rank(rows), rel=1e-4)


def test_a_common_component_does_not_hide_the_difference():
    """Tokens sharing a large component (c about 0.7, as a vision tower gives): the uncentred
    participation ratio counts about two distinct tokens for a busy image, here about the effective
    rank's six; a flat image whose tokens differ only by a small jitter (its centred rows alone look
    rich) still counts about one."""
    g = torch.Generator().manual_seed(3)
    common = 1.5 * torch.randn(1, 64, generator=g)
    busy = common + torch.randn(100, 64, generator=g)
    flat = common + 0.05 * torch.randn(100, 64, generator=g)
    unit = F.normalize(busy, dim=-1)
    assert 100 ** 2 / (unit @ unit.T).square().sum().item() < 2.5  # the uncentred participation ratio
    assert distinct_token_count(busy).item() == pytest.approx(effective_rank(busy), rel=0.1)
    assert distinct_token_count(flat).item() == pytest.approx(1.0, abs=0.05)


def test_weigh_images_scales_each_image_to_its_distinct_tokens():
    g = torch.Generator().manual_seed(0)
    plain = torch.randn(1, 8, generator=g).repeat(16, 1) + 0.01 * torch.randn(16, 8, generator=g)
    dense = torch.randn(16, 8, generator=g)
    importance = torch.cat([torch.full((16,), 4.0), torch.full((16,), 4.0)])  # uniform: sums 4 * N each
    assert torch.equal(weigh_images(importance, [plain, dense], "size"), importance)
    weighed = weigh_images(importance, [plain, dense], "distinct")
    for part, embeds in zip(weighed.split(16), (plain, dense)):
        assert part.sum().item() == pytest.approx(4 * distinct_token_count(embeds).item(), rel=1e-5)
    assert weighed[:16].sum() < 0.25 * weighed[16:].sum()
    with pytest.raises(ValueError, match="budget weighting"):
        weigh_images(importance, [plain, dense], "area")


def test_repetitive_image_gives_way_under_one_budget():
    """Same attention pattern in both images; one image's tokens all look alike (a flat colour)."""
    g = torch.Generator().manual_seed(1)
    pattern = torch.rand(64, generator=g) * 8
    flat = torch.randn(1, 32, generator=g).repeat(64, 1) + 0.05 * torch.randn(64, 32, generator=g)
    busy = torch.randn(64, 32, generator=g)
    keys = [torch.randn(64, 8, generator=g) for _ in range(2)]
    by_size = select_tokens(list(weigh_images(torch.cat([pattern, pattern]), [flat, busy], "size").split(64)),
                            keys, 0.5)
    assert len(by_size[0].kept) == len(by_size[1].kept)  # the same attention pattern, the same share
    flat_sel, busy_sel = select_tokens(list(weigh_images(torch.cat([pattern, pattern]), [flat, busy],
                                                         "distinct").split(64)), keys, 0.5)
    assert len(busy_sel.kept) > 2 * len(flat_sel.kept) and len(flat_sel.kept) >= 4  # the floor still holds
    assert len(busy_sel.kept) + len(flat_sel.kept) == 64

