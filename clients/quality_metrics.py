"""Answer scoring for the quality harness: exact match and token-level F1 (SQuAD style).

Input: a generated answer and one or more reference answers (strings). Output: floats in [0, 1].
Used for task set v2 (`build/taskset_v2.py`, answers of 5-40 tokens), where a partly right list
("MILK 1.99, EGGS 2.79" for "MILK 1.99, EGGS 2.97") should score between 0 and 1; by
`build/train_v2.py` on its teacher-forced validation answers and, once wired in, by
`clients/eval_quality.py` per row. Pure Python, no dependencies.

Normalisation (SQuAD v1.1's `normalize_answer`, unchanged):
  1. lower case;
  2. delete every ASCII punctuation character (`string.punctuation`): "3.49" -> "349",
     "2024-05-17" -> "20240517", "MILK 1.99," -> "milk 199";
  3. delete the articles "a", "an", "the" as whole words;
  4. split on whitespace and re-join with single spaces.
Tokens are the whitespace-separated words of the normalised text. F1 is the harmonic mean of
precision and recall over the multiset of common tokens; if either side normalises to no tokens,
F1 is 1.0 when both do and 0.0 otherwise (SQuAD v2's rule). With several references a prediction
gets its best score over them.

Because punctuation is deleted, a price stays one token ("349") and a wrong digit anywhere in it
makes the whole token wrong, while "3.49" and "34.9" compare equal (no task set v2 answer has
both forms).
"""
from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Iterable, Sequence

__all__ = ["normalize_answer", "answer_tokens", "exact_match", "token_f1", "best_score", "mean_scores"]

_PUNCTUATION = frozenset(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")


def normalize_answer(text: str) -> str:
    """SQuAD v1.1 normalisation: lower case, no punctuation, no articles, single spaces."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in _PUNCTUATION)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def answer_tokens(text: str) -> list[str]:
    return normalize_answer(text).split()


def exact_match(prediction: str, reference: str) -> float:
    """1.0 when both normalise to the same text, else 0.0."""
    return float(normalize_answer(prediction) == normalize_answer(reference))


def token_f1(prediction: str, reference: str) -> float:
    """Harmonic mean of token precision and recall after normalisation (bag of tokens)."""
    pred, ref = answer_tokens(prediction), answer_tokens(reference)
    if not pred or not ref:
        return float(pred == ref)
    common = sum((Counter(pred) & Counter(ref)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred), common / len(ref)
    return 2 * precision * recall / (precision + recall)


def best_score(prediction: str, references: str | Sequence[str]) -> tuple[float, float]:
    """(exact match, F1) against the best-matching reference, as SQuAD scores several."""
    refs = [references] if isinstance(references, str) else list(references)
    if not refs:
        raise ValueError("at least one reference answer is needed")
    return max(exact_match(prediction, r) for r in refs), max(token_f1(prediction, r) for r in refs)


def mean_scores(pairs: Iterable[tuple[str | None, str | Sequence[str]]]) -> dict[str, float]:
    """Mean exact match and F1 over (prediction, reference(s)) pairs; a None prediction (a failed
    request) scores 0 on both. Empty input gives zeros and n = 0."""
    n, em, f1 = 0, 0.0, 0.0
    for prediction, references in pairs:
        n += 1
        if prediction is not None:
            e, f = best_score(prediction, references)
            em, f1 = em + e, f1 + f
    return {"n": n, "exact": em / n if n else 0.0, "f1": f1 / n if n else 0.0}
