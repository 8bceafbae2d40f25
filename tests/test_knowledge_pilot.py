"""build/knowledge_pilot.py: the price-list facts as text, and a short run's per-K' recall rows."""
from __future__ import annotations

import torch

from zipmoe.build import knowledge_pilot as kp
from zipmoe.build import taskset_v2 as ts


def test_facts_are_every_price_list_entry_with_only_the_price_scored():
    vocab = kp.vocabulary()
    ids, labels = kp.facts(vocab, kp.price_lists(8))
    scored = labels != -100
    assert torch.equal(labels[scored], ids[scored])  # labels are the ids where scored
    words = {i: w for w, i in vocab.items()}
    assert len(ids) == len(ts.STORES) * len(ts.ITEMS)
    for row, mask in zip(ids[:5].tolist(), scored[:5].tolist()):
        item, store = words[row[0]], " ".join(words[i] for i in row[kp.ANSWER_FROM:kp.ANSWER_FROM + 2])
        price = "".join(words[i] for i, m in zip(row, mask) if m)
        assert price == ts.PRICE_LISTS[store][item] + "<end>"
        assert not any(mask[:kp.ANSWER_FROM + 2])  # the item and the store are given, never scored


def test_a_short_run_reports_every_keep_and_no_experts_is_worse_than_all():
    result = kp.run(minutes=0.05, batch=8, keeps=(8, 2, 0))
    assert [r["keep"] for r in result["rows"]] == [8, 2, 0] and result["steps"] >= 1
    assert all(0 <= r["token_accuracy"] <= 1 and 0 <= r["prices_exact"] <= 1 for r in result["rows"])
    assert result["rows"][0]["loss"] != result["rows"][2]["loss"]  # keep 0 drops the experts at the answer


def test_sixty_four_stores_are_every_pairing_of_the_names_words():
    lists = kp.price_lists(64)
    assert len(lists) == 64 and set(ts.STORES) <= set(lists)
    assert all(set(prices) == set(ts.ITEMS) for prices in lists.values())
