"""VisionZip visual-token compression with one budget per request.

VisionZip (arXiv 2412.04467) keeps the "dominant" visual tokens — those that receive the most
attention at a deep vision layer — and folds part of the rest into a few "contextual" tokens.
Its public Qwen2.5-VL port handles one image; here all images of a request share one token
budget: above a per-image floor, each image's share follows its weight (its distinct tokens by
default), so a detail-dense image (text, tables, receipts) keeps more tokens than a plain one at
every keep ratio, and attention picks the tokens inside each image.

Pipeline (vision_encoder): patch importance on layer ℓ's q/k (kernels/attention_importance.py:
`patch_importance`, a Triton kernel that never materialises the N x N attention matrix, or its
reference `patch_importance_reference`) -> `merged_importance` (2x2 merger) -> `select_tokens` ->
`apply_selection` on the merged embeddings and on the deepstack features, with the same selection
so both stay aligned. Kept tokens keep their original order, so their original (t, h, w) mRoPE
positions are `positions[kept]`.

Plain PyTorch. Everything is deterministic.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.special import xlogy

from .settings import setting


def distinct_token_count(embeds: Tensor) -> Tensor:
    """Effective number of distinct tokens among an image's merged embeddings [..., N, D] (a batch
    of same-size images -> [...]): exp of the entropy of how the unit-normalised tokens' energy
    spreads over directions. A share c = |mean|^2 lies along the mean token; the rest, 1 - c, is the
    variation around it, taken as spread evenly over its participation ratio P = tr(C)^2 / ||C||_F^2
    (C the Gram matrix of the centred rows), so D = c^-c (P / (1 - c))^(1 - c).

    1 when all tokens point one way (a solid background; also all-zero rows), N when they are
    mutually orthogonal, k for k orthogonal directions repeated evenly: the entropy of the Gram
    matrix's spectrum (the effective rank) in those cases, without an eigendecomposition. Why not
    the participation ratio of the uncentred Gram: a vision tower gives all its tokens a large
    common component, and that squared measure is ruled by its largest eigenvalue, so it counts
    about two distinct tokens for a receipt and for a photo alike. Why not the centred tokens alone:
    a solid image's tokens still differ by position, and its centred variation looks rich; here that
    variation counts only with its small share 1 - c. Computed through the smaller of X X^T and X^T X
    (same Frobenius norm)."""
    x = F.normalize(embeds.float(), dim=-1)
    n, d = x.shape[-2:]
    mean = x.mean(-2, keepdim=True)
    common = mean.square().sum((-2, -1)).clamp(0.0, 1.0)  # c: 1 when every row is the same unit vector
    centred = x - mean
    ct = centred.transpose(-1, -2)
    gram = centred @ ct if n <= d else ct @ centred
    squares = gram.square().sum((-2, -1))
    trace = gram.diagonal(dim1=-2, dim2=-1).sum(-1)  # the centred rows' energy, read off the Gram already made
    spread = torch.where(squares > 0, trace.square() / squares.clamp_min(1e-30), 1.0)
    entropy = -xlogy(common, common) - xlogy(1 - common, 1 - common) + (1 - common) * spread.log()
    return entropy.exp().clamp(1.0, n)


BUDGET_WEIGHTINGS = ("distinct", "size")


def check_budget_weighting(weighting: str) -> str:
    if weighting not in BUDGET_WEIGHTINGS:
        raise ValueError(f"budget weighting must be one of {BUDGET_WEIGHTINGS}, got {weighting!r}")
    return weighting


def weigh_images(importance: Tensor, embeds: list[Tensor], weighting: str) -> Tensor:
    """Scales each image's merged-token importance (packed [sum N_i]; each image's sums to its
    patch count, 4 N_i with a 2x2 merger) by how much of the request's budget the image may claim:
    select_tokens shares the budget above the floors in proportion to each image's mass.

    size: unchanged, every token counts (the paper's per-image normalisation): images keep about
    the same fraction of their tokens, whatever they show. distinct: image i's mass becomes 4 D_i
    (`distinct_token_count`), so tokens that repeat one another (a plain background, a flat
    colour) claim little of the shared budget and detail-dense images (text, tables) keep more."""
    if check_budget_weighting(weighting) == "size" or not embeds:
        return importance
    sizes = [e.shape[0] for e in embeds]
    share = torch.empty(len(embeds), device=importance.device)
    for n in set(sizes):  # one batched Gram per image size (usually one), not one per image
        same = [i for i, s in enumerate(sizes) if s == n]
        share[same] = distinct_token_count(torch.stack([embeds[i] for i in same])) / n
    return importance * share.repeat_interleave(torch.tensor(sizes, device=importance.device),
                                                output_size=importance.shape[0])


def merged_importance(patch_imp: Tensor, merge: int = 4) -> Tensor:
    """[P] -> [P // merge]: a merged token's importance is the sum over its `merge` patches
    (consecutive in Qwen's flatten order)."""
    if patch_imp.shape[0] % merge:
        raise ValueError(f"{patch_imp.shape[0]} patches are not a multiple of merge={merge}")
    return patch_imp.reshape(-1, merge).sum(dim=-1)


@dataclass
class ImageSelection:
    kept: Tensor        # int64 [K_i] indices into the image's merged tokens, ascending
    is_context: Tensor  # bool [K_i] True where kept[j] is a contextual (merged) token
    assign: Tensor      # int64 [N_i] row of `kept` each token is folded into; -1: dropped outright


def _round_half_up(x: float) -> int:
    # Python's round() rounds halves to even; half-up makes the budget monotone in keep_ratio.
    return math.floor(x + 0.5)


def apportion(weights: list[float], total: int, caps: list[int]) -> list[int]:
    """Webster's divisor method with caps: counts 0 <= n_i <= caps[i] summing to `total` (at most
    sum(caps)), n_i about total * w_i / sum(w).

    The (k+1)-th unit of item i has priority w_i / (k + 1/2); the top `total` priorities over all
    items are given out, ties to the heavier item, then the earlier one. The priorities do not
    depend on `total`, so a larger total never gives an item less (house monotone). An item's next
    unit never ranks below a lighter item's unit at the same or a higher count, so
    n_a >= min(n_b, caps[a]) whenever a ranks before b (w_a > w_b, or w_a == w_b and a < b).
    Webster's divisor (k + 1/2) favours neither heavy nor light items."""
    ranked = torch.tensor(sorted(range(len(weights)), key=lambda i: (-weights[i], i)), dtype=torch.long)
    ranked_caps = torch.tensor(caps, dtype=torch.long)[ranked]
    owner = ranked.repeat_interleave(ranked_caps)  # every seat of every item, items by rank
    starts = ranked_caps.cumsum(0) - ranked_caps
    seat = (torch.arange(owner.shape[0]) - starts.repeat_interleave(ranked_caps)).double()  # 0, 1, .. per item
    priority = torch.tensor(weights, dtype=torch.float64)[owner] / (seat + 0.5)
    # Laid out by rank, seats ascending: a stable descending sort breaks ties by rank. Division
    # rounds monotonically, so the order argued above survives float64.
    top = torch.sort(priority, descending=True, stable=True).indices[:total]
    return torch.bincount(owner[top], minlength=len(weights)).tolist()


def select_tokens(importance: list[Tensor], keys: list[Tensor], keep_ratio: float,
                  context_fraction: float = 0.05, min_per_image: int = 4) -> list[ImageSelection]:
    """Choose the kept tokens of every image of one request under one budget.

    importance[i]: [N_i] merged-token importance (weighted by `weigh_images`); keys[i]: [N_i, dk]
    keys of the same tokens (for context folding). Budget B = round(keep_ratio * N) tokens over all
    N = sum N_i tokens, at least the floors' sum (F_i = min(N_i, min_per_image)), at most N; exactly
    B are kept. Image i keeps K_i = F_i + E_i tokens: the B - sum F_i tokens above the floors are
    apportioned (`apportion`) in proportion to its weight W_i, the sum of its importance (4 D_i by
    distinct tokens, 4 N_i by size), at most N_i - F_i each. Then it keeps its top K_i - C_i tokens
    by importance (dominant) and C_i contextual ones (targets spread over its other tokens, which
    are folded into their most key-similar target). C = round(context_fraction * B) per request
    (0 when B = N) is apportioned by dropped tokens N_i - K_i; image i holds at most
    min(K_i - F_i, N_i - K_i) of them (its floor stays dominant, a target needs a token to fold),
    so C is lower when the images cannot hold it.

    Guaranteed for any images a, b of a request and keep ratios r < r':
    - monotone: K_i(r) <= K_i(r') for every image;
    - ordered: if W_a > W_b, or W_a == W_b and a comes first, then K_a >= min(K_b, N_a) at every
      keep ratio: a keeps at least as many tokens as b unless it keeps all of its own.
    The order is fixed by the weights, whatever the keep ratio, so lowering keep never reverses
    which of two images keeps more, except where the one ahead was kept whole and is smaller
    (never between images of one size). A global top-k by importance cannot promise this: two
    images' importance distributions may cross.
    """
    if not 0.0 < keep_ratio <= 1.0:
        raise ValueError(f"keep_ratio must be in (0, 1], got {keep_ratio}")
    sizes = [imp.shape[0] for imp in importance]
    floors = [min(n, min_per_image) for n in sizes]
    total = sum(sizes)
    budget = min(total, max(sum(floors), _round_half_up(keep_ratio * total)))
    above = apportion([float(imp.double().sum()) for imp in importance], budget - sum(floors),
                      [n - f for n, f in zip(sizes, floors)])
    kept_counts = [f + e for f, e in zip(floors, above)]
    dropped = [n - k for n, k in zip(sizes, kept_counts)]
    room = [min(k - f, d) for k, f, d in zip(kept_counts, floors, dropped)]
    n_context = 0 if budget == total else min(sum(room), _round_half_up(context_fraction * budget))
    context_counts = apportion([float(d) for d in dropped], n_context, room)

    selections: list[ImageSelection | None] = [None] * len(importance)
    for n in dict.fromkeys(sizes):  # one batched pass per image size (a request usually has one or two)
        same = [i for i, size in enumerate(sizes) if size == n]
        kept, is_target, assign = _select_same_size(
            torch.stack([importance[i].float() for i in same]), [keys[i] for i in same],
            [kept_counts[i] for i in same], [context_counts[i] for i in same])
        # Each image's kept tokens and context flags: one pass over the group, split per image.
        counts = kept.sum(1).tolist()
        kept_tokens = kept.nonzero(as_tuple=True)[1].split(counts)
        context = is_target[kept].split(counts)
        for row, i in enumerate(same):
            selections[i] = ImageSelection(kept=kept_tokens[row], is_context=context[row], assign=assign[row])
    return selections


def _select_same_size(importance: Tensor, keys: list[Tensor], kept_per_image: list[int],
                      context_per_image: list[int]):
    """select_tokens' choice for B images of N tokens at once (no per-image loop: a request of 30
    images is a handful of batched ops, not hundreds of small ones). importance [B, N], keys B x
    [N, dk] (read only when tokens are folded), counts per image. Returns kept and is_target masks
    [B, N] and assign [B, N], on importance's device."""
    b, n = importance.shape
    device = importance.device
    kept_counts = torch.tensor(kept_per_image, device=device)
    context_counts = torch.tensor(context_per_image, device=device)
    tokens = torch.arange(n, device=device).expand(b, n)
    # Dominant: each image's top K_i - C_i by importance, ties to the lower token.
    order = torch.sort(importance, dim=1, descending=True, stable=True).indices
    rank = torch.empty_like(order).scatter_(1, order, tokens)
    dominant = rank < (kept_counts - context_counts)[:, None]
    # Targets: C_i evenly spaced over the remaining tokens in index order (distinct as C_i <= R_i):
    # slot j takes the remaining token of rank j R_i // C_i, the first token where the running
    # count of remaining tokens exceeds that rank.
    slots = torch.arange(max(context_per_image), device=device)
    valid = slots[None, :] < context_counts[:, None]  # [B, Cmax]: slot j < C_i is a real target
    place = slots[None, :] * (n - kept_counts + context_counts)[:, None] // context_counts.clamp_min(1)[:, None]
    remaining_so_far = (~dominant).long().cumsum(1)
    targets = torch.searchsorted(remaining_so_far, place + 1).clamp_max(n - 1)  # [B, Cmax] token of each slot
    is_target = torch.zeros(b, n, dtype=torch.bool, device=device)
    is_target[valid.nonzero(as_tuple=True)[0], targets[valid]] = True
    kept = dominant | is_target
    row = torch.where(kept, kept.long().cumsum(1) - 1, -1)  # each kept token's row, in token order
    assign = row.clone()  # kept tokens map to themselves, the rest to -1 until folded
    folded = ~kept & valid.any(1, keepdim=True)
    if folded.any():
        unit = F.normalize(torch.stack(keys).to(device, torch.float32), dim=-1)
        similarity = unit @ torch.gather(unit, 1, targets[..., None].expand(-1, -1, unit.shape[-1])).transpose(1, 2)
        similarity.masked_fill_(~valid[:, None, :], float("-inf"))
        nearest = similarity.argmax(dim=2)  # cosine; ties: first target
        assign = torch.where(folded, torch.gather(row, 1, torch.gather(targets, 1, nearest)), assign)
    return kept, is_target, assign


def apply_selection(features: Tensor, sel: ImageSelection) -> Tensor:
    """[..., N_i, D] -> [..., K_i, D] (token axis second to last: embeddings [N_i, D] or
    deepstack [L, N_i, D]). Each kept row is the mean of the rows assigned to it: a dominant
    token is assigned only itself, so it is copied exactly; a contextual one averages its group."""
    if sel.kept.shape[0] == features.shape[-2]:
        return features  # everything kept (keep_ratio 1.0): nothing is folded, no copy needed
    # The selection is made on the host (small, branchy); the features may live on the GPU. Index
    # arrays and counts are built on the host and copied over: no read-back from the device (a
    # bool-mask index or a device bincount would wait for it).
    source = (sel.assign >= 0).nonzero().squeeze(1)
    target = sel.assign[source]
    counts = torch.bincount(target, minlength=sel.kept.shape[0]).unsqueeze(-1)
    source, target, counts = (t.to(features.device, non_blocking=True) for t in (source, target, counts))
    # Accumulate in float32 so contextual means of bf16 features do not lose precision.
    sums = features.new_zeros(*features.shape[:-2], sel.kept.shape[0], features.shape[-1],
                              dtype=torch.float32)
    sums.index_add_(-2, target, features.index_select(-2, source).float())
    return (sums / counts).to(features.dtype)


@dataclass(frozen=True)
class VisionZipConfig:
    """VisionZip's settings: parameters of vision_encoder/config.pbtxt (mm_qa_bls reads them from there)."""
    keep_ratio: float = setting(0.6, "fraction of a request's visual tokens kept (one budget shared by its images); "
                                     "a request may override it with visual_keep_ratio", min=1e-6, max=1.0)
    keep_ratio_min: float = setting(0.3, "under load (moe_decoder's ttft_target_ms) the keep ratio of a request of "
                                         "priority >= 1 is lowered step by step down to this (serving/load.py)",
                                    min=1e-6, max=1.0)
    context_fraction: float = setting(0.05, "share of the kept tokens that are contextual (merged from the dropped)",
                                      min=0.0, max=1.0)
    min_tokens_per_image: int = setting(4, "every image keeps at least this many tokens, however plain", min=0)


@dataclass
class ImageFeatures:
    """One image after the vision tower, before compression (what the BLS cache holds)."""
    embeds: Tensor  # [N, D] merged tokens
    deepstack: Tensor  # [L, N, D]
    importance: Tensor  # [N] on the host
    keys: Tensor  # [N, dk] on the host
    grid: tuple[int, int]  # merged grid (rows, cols)


@dataclass
class ImageTokens:
    """What the decoder needs of one image after VisionZip."""
    embeds: Tensor  # [K, D] kept tokens, original order
    deepstack: Tensor  # [L, K, D] pruned with the same selection
    positions: Tensor  # [K, 2] (row, col) of each kept token in the merged grid
    grid: tuple[int, int]


def compress(images: list[ImageFeatures], keep_ratio: float, context_fraction: float = 0.05,
             min_per_image: int = 4) -> list[ImageTokens]:
    """VisionZip for one request: its images share one budget. The folding runs once for all images
    (two scatter-adds in all, whatever the image count), so it stays cheap on a GPU."""
    if not images:
        return []
    sels = select_tokens([f.importance for f in images], [f.keys for f in images], keep_ratio,
                         context_fraction, min_per_image)
    kept = [len(s.kept) for s in sels]
    kept_counts = torch.tensor(kept)
    # (row, col) in the merged grid of every kept token, all images at once, then split per image.
    tokens = torch.cat([s.kept for s in sels])
    cols = torch.tensor([f.grid[1] for f in images]).repeat_interleave(kept_counts, output_size=len(tokens))
    positions = torch.stack([tokens // cols, tokens % cols], dim=1).split(kept)
    if kept == [f.embeds.shape[0] for f in images]:  # nothing dropped (keep 1.0): no copies
        return [ImageTokens(f.embeds, f.deepstack, p, f.grid) for f, p in zip(images, positions)]
    # One selection over the concatenated tokens of all images: rows of image i shift by its offset.
    assign = torch.cat([s.assign for s in sels])
    offsets = (kept_counts.cumsum(0) - kept_counts).repeat_interleave(torch.tensor([len(s.assign) for s in sels]),
                                                                      output_size=len(assign))
    assign = torch.where(assign >= 0, assign + offsets, -1)
    combined = ImageSelection(kept=torch.arange(sum(kept)), is_context=torch.cat([s.is_context for s in sels]),
                              assign=assign)
    embeds = apply_selection(torch.cat([f.embeds for f in images]), combined).split(kept)
    deepstack = apply_selection(torch.cat([f.deepstack for f in images], dim=1), combined).split(kept, dim=1)
    return [ImageTokens(e, d, p, f.grid) for e, d, p, f in zip(embeds, deepstack, positions, images)]


def decoder_inputs(tokens: list[ImageTokens], width: int = 0, layers: int = 0) -> dict[str, torch.Tensor | np.ndarray]:
    """moe_decoder's visual inputs for one request's kept tokens (interface.VISUAL_TOKENS): the
    embeddings and DeepStack features stay where the vision tower made them (the GPU, in bf16, handed
    on through DLPack without a host copy); the small index arrays are host int32. Without images
    they are empty tensors of the right rank, shaped by width (hidden size) and layers (deepstack)."""
    if not tokens:
        return {"visual_embeds": torch.zeros(0, width, dtype=torch.bfloat16),
                "deepstack_embeds": torch.zeros(layers, 0, width, dtype=torch.bfloat16),
                "visual_positions": np.zeros((0, 2), np.int32), "image_grids": np.zeros((0, 2), np.int32),
                "visual_tokens_kept": np.zeros(0, np.int32)}
    return {
        "visual_embeds": torch.cat([t.embeds for t in tokens]).to(torch.bfloat16).contiguous(),
        "deepstack_embeds": torch.cat([t.deepstack for t in tokens], dim=1).to(torch.bfloat16).contiguous(),
        "visual_positions": torch.cat([t.positions for t in tokens]).int().cpu().numpy(),
        "image_grids": np.asarray([t.grid for t in tokens], np.int32),
        "visual_tokens_kept": np.asarray([t.embeds.shape[0] for t in tokens], np.int32),
    }
