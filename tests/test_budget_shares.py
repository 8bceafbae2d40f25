"""Issue 16: lowering keep must never reverse which of two images keeps more tokens. Checks
select_tokens' stated guarantee (monotone in keep, ordered by weight) over many synthetic requests
of a few hundred tokens per image, text-like and plain-like ones included, at keep 0.2 to 0.9."""
import itertools
import math

import pytest
import torch

from zipmoe.visionzip import select_tokens, weigh_images

KEEPS = [round(0.2 + 0.05 * i, 2) for i in range(15)]  # 0.2, 0.25, ..., 0.9
KINDS = ("text", "plain", "random")


def _image(kind: str, n: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(importance summing to 4 n as patch_importance's does, merged embeddings [n, 64]).
    text: attention peaked on a few tokens, embeddings all different; plain: nearly uniform
    attention, embeddings close to one direction (a flat background); random: in between."""
    if kind == "text":
        imp, spread = torch.rand(n, generator=g) ** 6, 1.0
    elif kind == "plain":
        imp, spread = 1 + 0.1 * torch.rand(n, generator=g), 0.05
    else:
        peak, spread = 6 * torch.rand(1, generator=g).item(), torch.rand(1, generator=g).item()
        imp = torch.rand(n, generator=g) ** peak
    embeds = torch.randn(1, 64, generator=g) + spread * torch.randn(n, 64, generator=g)
    return imp * (4 * n / imp.sum()), embeds


def _requests(count: int, seed: int = 0):
    """(kinds, sizes, weighting, generator) of random requests of two or three images, half of one
    size; the generator draws their images next."""
    g = torch.Generator().manual_seed(seed)
    for r in range(count):
        m = 2 + r % 2
        kinds = [KINDS[int(k)] for k in torch.randint(0, 3, (m,), generator=g)]
        if r % 4 < 2:
            sizes = [int(torch.randint(150, 400, (1,), generator=g))] * m
        else:
            sizes = torch.randint(150, 400, (m,), generator=g).tolist()
        yield kinds, sizes, ("distinct", "size")[r % 3 == 2], g


def _counts(importance: list[torch.Tensor], keys: list[torch.Tensor]) -> dict[float, list[int]]:
    return {keep: [len(s.kept) for s in select_tokens(importance, keys, keep)] for keep in KEEPS}


@pytest.mark.parametrize("seed", range(5))
def test_shares_are_monotone_and_never_flip(seed):
    for kinds, sizes, weighting, g in _requests(40, seed):
        images = [_image(k, n, g) for k, n in zip(kinds, sizes)]
        importance = list(weigh_images(torch.cat([imp for imp, _ in images]), [e for _, e in images],
                                       weighting).split(sizes))
        keys = [torch.randn(n, 8, generator=g) for n in sizes]
        counts = _counts(importance, keys)
        weights = [imp.double().sum().item() for imp in importance]
        for keep, kept in counts.items():
            assert sum(kept) == math.floor(keep * sum(sizes) + 0.5)  # exactly B (floors are far below it)
            assert all(4 <= k <= n for k, n in zip(kept, sizes))
        for low, high in zip(KEEPS, KEEPS[1:]):  # monotone in keep, every image
            assert all(a <= b for a, b in zip(counts[low], counts[high]))
        for a, b in itertools.permutations(range(len(sizes)), 2):
            if (weights[a], -a) > (weights[b], -b):  # a ranks before b: ordered at every keep
                assert all(kept[a] >= min(kept[b], sizes[a]) for kept in counts.values())
            if sizes[a] == sizes[b]:  # one size: which keeps more never reverses
                signs = {(kept[a] > kept[b]) - (kept[a] < kept[b]) for kept in counts.values()}
                assert not {1, -1} <= signs, (kinds, weighting, counts)


def test_text_image_keeps_more_than_a_plain_one_at_every_keep():
    g = torch.Generator().manual_seed(7)
    (text_imp, text_emb), (plain_imp, plain_emb) = _image("text", 300, g), _image("plain", 300, g)
    keys = [torch.randn(300, 8, generator=g) for _ in range(2)]
    by_distinct = _counts(list(weigh_images(torch.cat([text_imp, plain_imp]), [text_emb, plain_emb],
                                            "distinct").split(300)), keys)
    assert all(text > plain for text, plain in by_distinct.values())
    # By size two images of one size share evenly, however their attention is shaped.
    by_size = _counts([text_imp, plain_imp], keys)
    assert all(abs(text - plain) <= 1 for text, plain in by_size.values())
