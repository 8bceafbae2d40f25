"""Task set v2 (build/taskset_v2.py): determinism, disjoint splits, token counts per image, answer
lengths in the trained tokenizer, answers that agree with the facts, characters drawn as planned."""
from __future__ import annotations

import re
from collections import Counter

import numpy as np
import pytest
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

from zipmoe.build import taskset_v2 as ts
from zipmoe.build.taskset_v2_docs import CHARSET, SIDES, Form, Photo, Receipt, Shelf, Table

# tests/ is on sys.path (it is no package): notes_data's checks, shared
from test_notes_data import FIELDS, check_cli, digest, digests_in_another_process

N_PLANS = 1500  # facts only: cheap
N_IMAGES = 60  # drawn examples


@pytest.fixture(scope="module")
def plans():
    return {split: ts.plans(split, N_PLANS) for split in ts.SPLITS}


@pytest.fixture(scope="module")
def drawn():
    return ts.examples("train", N_IMAGES)


V2_FIELDS = (*FIELDS, "marks")  # notes_data's digest, plus where every character was drawn


def test_deterministic_in_process_and_across_processes():
    assert digest(ts.make_example(4), V2_FIELDS) == digest(ts.make_example(4), V2_FIELDS)
    assert digest(ts.make_example(4), V2_FIELDS) != digest(ts.make_example(5), V2_FIELDS)
    assert ts.plan(123) == ts.plan(123)
    assert (digests_in_another_process("taskset_v2", (3, 10), V2_FIELDS, hash_seed="4321")
            == [digest(ts.make_example(s), V2_FIELDS) for s in (3, 10)])


def test_example_is_its_plan_drawn():
    for seed in range(10):
        ex, plan = ts.make_example(seed), ts.plan(seed)
        assert (ex.question, ex.answer, ex.task) == (plan.question, plan.answer, plan.task)
        assert ex.kinds == tuple(d.kind for d in plan.docs)
        assert [im.size for im in ex.images] == [d.size for d in plan.docs]


def test_splits_are_disjoint_and_cover_every_task(plans):
    seeds = {s: {ts.split_seed(s, i) for i in range(N_PLANS)} for s in ts.SPLITS}
    assert not (seeds["train"] & seeds["validation"]) and not (seeds["train"] & seeds["test"])
    assert not (seeds["validation"] & seeds["test"])
    assert [e.seed for e in ts.examples("test", 2, start=3)] == [ts.split_seed("test", i) for i in (3, 4)]
    for split, ps in plans.items():
        assert set(Counter(p.task for p in ps)) == set(ts.TASKS), split
    # different seeds draw different questions: no test question's images+answer repeat a train one
    # (a knowledge question's fact is asked in training on purpose: it is what the model must learn)
    train = {(p.question, p.answer) for p in plans["train"]}
    repeats = [(p.question, p.answer) in train for p in plans["test"] if p.task not in ts.KNOWLEDGE_TASKS]
    assert sum(repeats) < N_PLANS * 0.02
    share = Counter(p.task in ts.KNOWLEDGE_TASKS for p in plans["test"])[True] / N_PLANS
    assert ts.KNOWLEDGE_SHARE == 0.5 and 0.45 < share < 0.55  # half the questions ask what no image prints


def test_images_are_448_to_896_and_200_to_800_tokens(plans):
    """At patch 16 x merge 2: (W/32) x (H/32) merged tokens, 196..784 per image; Qwen's smart resize
    with train_v2's image processor (up to 1024 x 1024 pixels) leaves every size as drawn."""
    from zipmoe.build.train_v2 import MAX_PIXELS

    counts = Counter()
    for p in (p for ps in plans.values() for p in ps):
        assert ts.MIN_IMAGES <= len(p.docs) <= ts.MAX_IMAGES
        assert {"dense", "plain"} <= {d.kind for d in p.docs}
        assert sum(ts.merged_tokens(d.size) for d in p.docs) <= 4 * 784  # < moe_decoder's max_model_len 4096
        for d in p.docs:
            w, h = d.size
            assert 448 <= w <= 896 and 448 <= h <= 896 and w % 64 == 0 and h % 64 == 0
            tokens = ts.merged_tokens(d.size)
            assert 196 <= tokens <= 784
            counts[d.kind] += 1
    assert counts["plain"] > 0.3 * sum(counts.values()) and counts["dense"] > 0.3 * sum(counts.values())
    for w in SIDES:
        for h in SIDES:
            assert smart_resize(h, w, 32, 64 * 64, MAX_PIXELS) == (h, w)
    assert ts.merged_tokens((448, 448)) == 196 and ts.merged_tokens((896, 896)) == 784
    with pytest.raises(ValueError):
        ts.merged_tokens((450, 448))


def test_answers_are_5_to_40_tokens_of_the_trained_tokenizer(plans, tmp_path_factory):
    from zipmoe.build.tiny_checkpoint import build_tokenizer
    from zipmoe.build.train_v2 import TOKENIZER_VOCAB

    tok = build_tokenizer(tmp_path_factory.mktemp("tok"), ts.tokenizer_corpus(), TOKENIZER_VOCAB, split_digits=True)
    lengths = Counter()
    for p in (p for ps in plans.values() for p in ps):
        n = len(tok.encode(p.answer, add_special_tokens=False))
        assert 5 <= n <= 40, (p.task, p.answer, n)
        assert tok.decode(tok.encode(p.answer, add_special_tokens=False)) == p.answer
        lengths[n] += 1
    assert sum(n * c for n, c in lengths.items()) / sum(lengths.values()) > 10  # most answers are long


def _tags(shelf: Shelf):
    return [t for row in shelf.rows for t in row]


def test_answers_agree_with_the_facts_and_are_unambiguous(plans):
    for p in plans["train"]:
        q, a, docs = p.question, p.answer, p.docs
        i = int(m[1]) if (m := re.search(r"image (\d)", q)) else None
        d = docs[i - 1] if i else None
        if p.task == "receipt_line":
            item = re.fullmatch(r"what does the (\w+) line on the receipt in image \d say\?", q)[1]
            assert [f"{n} {v}" for n, v in d.items if n == item] == [a]
        elif p.task == "receipt_total":
            assert isinstance(d, Receipt) and a == f"TOTAL {d.total}"
            assert round(sum(float(v) for _, v in d.items), 2) == float(d.total)
        elif p.task == "receipt_list":
            k = int(re.search(r"first (\d)", q)[1])
            assert a == ", ".join(f"{n} {v}" for n, v in d.items[:k]) and 2 <= k <= 4
        elif p.task == "shelf_price":
            item = re.search(r"the (\w+) tag", q)[1]
            assert [f"{n} {v}" for n, v in _tags(d) if n == item] == [a]
        elif p.task == "shelf_row":
            row = re.search(r"the (\w+) shelf", q)[1]
            r = {2: ("top", "bottom"), 3: ("top", "middle", "bottom")}[len(d.rows)].index(row)
            assert a == ", ".join(f"{n} {v}" for n, v in d.rows[r])
        elif p.task == "table_cell":
            col, row = re.search(r"the (\w+) value for (\w+)\?", q).groups()
            assert a == dict(d.rows)[row][d.columns.index(col)]
        elif p.task == "table_row":
            label = re.search(r"the (\w+) row", q)[1]
            assert a == " ".join((label, *dict(d.rows)[label]))
        elif p.task == "form_field":
            field = re.search(r"the (\w+) on", q)[1]
            assert isinstance(d, Form) and a == dict(d.fields)[field] and field in ts.NUMERIC_FIELDS
        elif p.task == "form_pair":
            f1, f2 = re.search(r"the (\w+) and (\w+) on", q).groups()
            assert a == f"{dict(d.fields)[f1]}; {dict(d.fields)[f2]}" and {f1, f2} & set(ts.NUMERIC_FIELDS)
        elif p.task == "photo_shapes":
            assert isinstance(d, Photo) and len(d.shapes) in (2, 3)
            assert a.split(" and ")[-1] == f"a {d.shapes[-1][1]} {d.shapes[-1][0]}"
        elif p.task == "multi_total":
            i, j = map(int, re.search(r"images (\d) and (\d)", q).groups())
            assert a == f"{docs[i - 1].total} and {docs[j - 1].total}" and i < j
        elif p.task == "multi_find":
            item = re.search(r"a tag for (\w+),", q)[1]
            where = [k + 1 for k, x in enumerate(docs) if item in {n for n, _ in
                     (_tags(x) if isinstance(x, Shelf) else getattr(x, "items", ()))}]
            assert len(where) == 1 and isinstance(docs[where[0] - 1], Shelf)
            assert len([x for x in docs if isinstance(x, (Shelf, Receipt))]) >= 2  # something to search
            (price,) = [v for n, v in _tags(docs[where[0] - 1]) if n == item]
            assert a == f"image {where[0]}, {price}"
        elif p.task in ts.KNOWLEDGE_TASKS:
            items = re.split(r", | and ", re.search(r"what do(?:es)? (.+) cost", q)[1])
            where = [int(k) for k in re.findall(r"(\d)(?: and |\?)", q)]
            stores = [docs[k - 1].store for k in where]
            assert all(isinstance(docs[k - 1], Receipt) for k in where) and len(set(stores)) == len(where)
            if p.task == "store_price":  # one store, three items, each with its price
                assert len(set(items)) == ts.ASKED_PRICES and len(stores) == 1
                assert a == f"{stores[0]}, " + ", ".join(f"{it} {ts.PRICE_LISTS[stores[0]][it]}" for it in items)
            else:  # one item, two stores
                assert len(items) == 1 and len(stores) == 2
                assert a == ", ".join(f"{s} {ts.PRICE_LISTS[s][items[0]]}" for s in stores)
            # never printed: the items are on no document of the example, so no price is read anywhere
            assert not any(set(items) & {n for n, _ in (_tags(x) if isinstance(x, Shelf) else getattr(x, "items", ()))}
                           for x in docs)
        # names are unique inside every document, so "the X line / tag" has one answer
        for x in docs:
            names = [n for n, _ in (_tags(x) if isinstance(x, Shelf) else getattr(x, "items", ()))]
            assert len(names) == len(set(names))


def _printed(doc) -> str:
    """Every character the document prints, in drawing order, without spaces."""
    if isinstance(doc, Receipt):
        parts = [doc.store, doc.date, *(f"{n}{v}" for n, v in doc.items), "TOTAL", doc.total]
    elif isinstance(doc, Shelf):
        parts = [f"{n}{v}" for n, v in _tags(doc)]
    elif isinstance(doc, Table):
        parts = [*doc.columns, *(label + "".join(values) for label, values in doc.rows)]
    elif isinstance(doc, Form):
        parts = [doc.title, *(f"{k}:{v}" for k, v in doc.fields)]
    else:
        parts = []
    return "".join(parts).replace(" ", "")


def test_marks_are_the_printed_facts_inside_the_image(drawn):
    for ex in drawn:
        for im, marks, doc in zip(ex.images, ex.marks, ts.plan(ex.seed).docs):
            assert "".join(m.char for m in marks) == _printed(doc)
            assert all(ch in CHARSET for ch in _printed(doc))
            assert all(8 <= m.x < im.width - 8 and 8 <= m.y < im.height - 8 for m in marks)
            assert im.mode == "RGB"


def test_dense_images_carry_more_detail_than_plain(drawn):
    def edges(im):
        g = np.asarray(im.convert("L"), dtype=np.float32)
        return float((np.abs(np.diff(g, axis=1)) > 40).mean())

    dense = [edges(im) for ex in drawn for im, k in zip(ex.images, ex.kinds) if k == "dense"]
    plain = [edges(im) for ex in drawn for im, k in zip(ex.images, ex.kinds) if k == "plain"]
    assert np.mean(dense) > 3 * np.mean(plain)


def test_read_entry_examples_read_one_printed_entry_by_its_place():
    """Training-only read-entry examples: 2..4 images, one plain at least; the question names image i
    and entry k; the answer is that document's k-th entry as printed (every character on the image)."""
    for seed in range(60):
        p = ts.read_plan(seed)
        k, i = map(int, re.fullmatch(r"read entry (\d+) of image (\d+)\.", p.question).groups())
        assert p.task == ts.READ_TASK and ts.MIN_IMAGES <= len(p.docs) <= ts.MAX_IMAGES
        assert any(d.kind == "plain" for d in p.docs) and p.docs[i - 1].kind == "dense"
        assert p.answer == ts.entries(p.docs[i - 1])[k - 1]
        assert set(p.answer.replace(" ", "")) <= set(_printed(p.docs[i - 1]))
    ex = ts.make_example(5, read=True)
    assert (ex.question, ex.answer, ex.task) == (ts.read_plan(5).question, ts.read_plan(5).answer, ts.READ_TASK)
    assert ts.make_example(5).task in ts.TASKS  # the same seed's test-set example is untouched


def test_cli_writes_images_and_jsonl(tmp_path):
    for row, ex in check_cli(ts, "validation", 2, tmp_path):  # notes_data's files, plus each image's tokens
        assert row["tokens"] == [ts.merged_tokens(im.size) for im in ex.images]
