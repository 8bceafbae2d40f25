"""Exact match and token F1 (clients/quality_metrics.py) on hand-worked examples."""
from __future__ import annotations

import pytest

from zipmoe.clients.quality_metrics import (answer_tokens, best_score, exact_match, mean_scores, normalize_answer,
                                            token_f1)


@pytest.mark.parametrize("text, normalised", [
    ("The Cat sat.", "cat sat"),
    ("  MILK 1.99,   EGGS 2.79 ", "milk 199 eggs 279"),
    ("a red circle and a blue square", "red circle and blue square"),
    ("2024-05-17", "20240517"),
    ("an apple; the end!", "apple end"),
    ("banana", "banana"),  # "an" inside a word stays
    ("...", ""),
])
def test_normalize_answer_is_squads(text, normalised):
    assert normalize_answer(text) == normalised


def test_exact_match_after_normalisation():
    assert exact_match("BREAD 3.49", "bread 3.49.") == 1.0
    assert exact_match("The total: 45.67", "total 45.67") == 1.0
    assert exact_match("BREAD 3.49", "BREAD 3.46") == 0.0
    assert exact_match("", "") == 1.0


def test_token_f1_hand_examples():
    # one of two tokens right on each side: P = R = 1/2
    assert token_f1("BREAD 3.46", "BREAD 3.49") == pytest.approx(0.5)
    # prediction 4 tokens, reference 6, 4 common: P = 1, R = 2/3, F1 = 0.8
    assert token_f1("MILK 1.99, EGGS 2.79", "MILK 1.99, EGGS 2.79, TEA 4.10") == pytest.approx(0.8)
    # 3 of 5 predicted tokens in the 4 reference tokens: P = 3/5, R = 3/4, F1 = 2/3
    assert token_f1("image 3 and 2 49", "image 3, 2.49 and") == pytest.approx(2 * 0.6 * 0.75 / 1.35)
    assert token_f1("EGGS 2.79", "MILK 1.99") == 0.0
    assert token_f1("the", "a") == 1.0  # both empty after normalisation (SQuAD v2's rule)
    assert token_f1("", "MILK") == 0.0 and token_f1("MILK", "") == 0.0
    # a bag of tokens: repeats count as often as both sides have them, order does not matter
    assert token_f1("milk milk milk", "milk") == pytest.approx(2 * (1 / 3) * 1 / (1 / 3 + 1))
    assert token_f1("EGGS 2.79, MILK 1.99", "MILK 1.99, EGGS 2.79") == 1.0
    assert answer_tokens("a red circle, a blue square") == ["red", "circle", "blue", "square"]


def test_best_score_and_means():
    assert best_score("MILK 1.99", ["EGGS 2.79", "milk 1.99"]) == (1.0, 1.0)
    assert best_score("MILK 2.00", "MILK 1.99") == (0.0, 0.5)
    with pytest.raises(ValueError):
        best_score("x", [])
    scores = mean_scores([("BREAD 3.49", "BREAD 3.49"), ("BREAD 3.46", "BREAD 3.49"), (None, "MILK 1.99")])
    assert scores["n"] == 3
    assert scores["exact"] == pytest.approx(1 / 3) and scores["f1"] == pytest.approx(1.5 / 3)
    assert mean_scores([]) == {"n": 0, "exact": 0.0, "f1": 0.0}
