"""Synthetic multi-image notes QA data: determinism, splits, unambiguous answers, image properties.
Its digest and CLI checks serve tests/test_taskset_v2.py too."""
from __future__ import annotations

import hashlib
import io
import json
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from zipmoe.build import notes_data as nd

N = 300


@pytest.fixture(scope="module")
def sample():
    """N train examples with the facts (private plan) each was drawn from."""
    exs = nd.examples("train", N)
    return [(ex, nd._plan(ex.seed)) for ex in exs]


FIELDS = ("question", "answer", "task", "kinds")


def digest(ex, fields: tuple[str, ...] = FIELDS) -> str:
    """sha256 of an example's pixels and of the named fields (tests/test_taskset_v2.py adds its marks)."""
    h = hashlib.sha256()
    for im in ex.images:
        h.update(im.tobytes())
    h.update("|".join(str(getattr(ex, f)) for f in fields).encode())
    return h.hexdigest()


def digests_in_another_process(module: str, seeds: tuple[int, ...], fields: tuple[str, ...] = FIELDS,
                               hash_seed: str = "12345") -> list[str]:
    """digest() of zipmoe.build.<module>.make_example(seed) for each seed, computed by a fresh
    interpreter with another PYTHONHASHSEED: nothing may depend on set or dict order."""
    code = (f"import sys\nsys.path.insert(0, {str(Path(__file__).parent)!r})\n"
            f"from test_notes_data import digest\nfrom zipmoe.build import {module} as m\n"
            f"for s in {seeds!r}:\n    print(digest(m.make_example(s), {fields!r}))\n")
    env = dict(os.environ, PYTHONHASHSEED=hash_seed)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    return out.split()


def test_constants():
    w, h = nd.IMAGE_SIZE
    assert w % 32 == 0 and h % 32 == 0
    assert set(nd.TASKS) == {"read_price", "read_total", "find", "count", "compare", "colour"}


def test_deterministic_in_process():
    for seed in (0, 1, 17, 12345):
        a, b = nd.make_example(seed), nd.make_example(seed)
        assert a == b  # dataclass eq compares PIL images by pixels
        assert digest(a) == digest(b)
    assert digest(nd.make_example(0)) != digest(nd.make_example(1))


def test_deterministic_across_processes():
    assert digests_in_another_process("notes_data", (3, 4, 5)) == [digest(nd.make_example(s)) for s in (3, 4, 5)]


def test_splits_disjoint():
    seeds = {s: {nd.split_seed(s, i) for i in range(2000)} for s in nd.SPLITS}
    assert all(len(v) == 2000 for v in seeds.values())
    assert not (seeds["train"] & seeds["validation"])
    assert not (seeds["train"] & seeds["test"])
    assert not (seeds["validation"] & seeds["test"])
    got = [e.seed for e in nd.examples("validation", 3, start=5)]
    assert got == [nd.split_seed("validation", i) for i in (5, 6, 7)]
    with pytest.raises(ValueError):
        nd.split_seed("dev", 0)


def test_every_task_appears(sample):
    counts = Counter(ex.task for ex, _ in sample)
    assert set(counts) == set(nd.TASKS), counts


def test_structure(sample):
    for ex, plan in sample:
        assert 2 <= len(ex.images) <= 5
        assert len(ex.kinds) == len(ex.images)
        assert ex.kinds == tuple(n.kind for n in plan.notes)
        assert {"dense", "plain"} <= set(ex.kinds)  # every example mixes both families
        assert (ex.question, ex.answer, ex.task) == (plan.question, plan.answer, plan.task)
        assert ex.question == ex.question.lower() and ex.question.endswith("?")
        for im in ex.images:
            assert im.mode == "RGB" and im.size == nd.IMAGE_SIZE


def test_answers_agree_with_facts(sample):
    """Recompute every answer from the facts and check that each question has exactly one answer."""
    for ex, plan in sample:
        notes, q, a = plan.notes, ex.question, ex.answer
        if ex.task == "read_price":
            i = int(re.fullmatch(r"what is the price in image (\d)\?", q)[1])
            assert notes[i - 1].type == "price_tag" and a == str(notes[i - 1].price)
            assert 10 <= int(a) <= 99
        elif ex.task == "read_total":
            receipts = [n for n in notes if n.type == "receipt"]
            assert len(receipts) == 1
            (r,) = receipts
            assert len(r.items) in (2, 3) and all(10 <= v <= 99 for _, v in r.items)
            assert a == str(sum(v for _, v in r.items)) and int(a) <= 99
        elif ex.task == "find":
            colour, shape = re.fullmatch(r"which image shows a (\w+) (\w+)\?", q).groups()
            hits = [k + 1 for k, n in enumerate(notes) if n.type == "shape" and (n.colour, n.shape) == (colour, shape)]
            assert hits == [int(a)]
        elif ex.task == "count":
            shape = re.fullmatch(r"how many images show a (\w+)\?", q)[1]
            assert shape in nd.SHAPES
            assert a == str(sum(n.type == "shape" and n.shape == shape for n in notes))
            assert 0 <= int(a) <= 5
        elif ex.task == "compare":
            i, j = map(int, re.fullmatch(r"which image has the higher price, (\d) or (\d)\?", q).groups())
            assert i != j and notes[i - 1].type == notes[j - 1].type == "price_tag"
            pi, pj = notes[i - 1].price, notes[j - 1].price
            assert pi != pj and a == str(i if pi > pj else j)
        elif ex.task == "colour":
            i = int(re.fullmatch(r"what colour is the shape in image (\d)\?", q)[1])
            assert notes[i - 1].type == "shape" and a == notes[i - 1].colour
        else:
            raise AssertionError(ex.task)


def _nearest_colour(rgb) -> str:
    return min(nd.COLOURS, key=lambda c: sum((x - y) ** 2 for x, y in zip(nd.COLOURS[c], rgb)))


def test_plain_pixels_match_facts(sample):
    """Plain images show what the facts say: solid colour, or one shape of the right colour and outline."""
    fill_ratio = {"circle": np.pi / 4, "square": 1.0, "triangle": 0.5}
    for ex, plan in sample:
        for im, note in zip(ex.images, plan.notes):
            a = np.asarray(im, dtype=np.int16)
            if note.type == "solid":
                assert (a == a[0, 0]).all() and _nearest_colour(a[0, 0]) == note.colour
            elif note.type == "shape":
                fg = np.abs(a - a[0, 0]).sum(-1) > 30  # corners are background
                pix = a[fg]
                assert (pix == pix[0]).all() and _nearest_colour(pix[0]) == note.colour
                ys, xs = np.nonzero(fg)
                box = (ys.max() - ys.min() + 1) * (xs.max() - xs.min() + 1)
                assert abs(fg.sum() / box - fill_ratio[note.shape]) < 0.08, note.shape


def test_vocabulary_covers_questions_and_answers(sample):
    vocab = nd.vocabulary()
    assert vocab == sorted(set(vocab))
    words = set(vocab)
    for ex, _ in sample:
        for text in (ex.question, ex.answer):
            toks = nd.tokenize(text)
            assert "".join(toks) == text.replace(" ", "")
            assert set(toks) <= words, (text, set(toks) - words)


def test_dense_images_have_more_detail(sample):
    def grad(im):
        g = np.asarray(im.convert("L"), dtype=np.float32)
        return float(np.abs(np.diff(g, axis=1)).mean())

    dense = [grad(im) for ex, _ in sample for im, k in zip(ex.images, ex.kinds) if k == "dense"]
    plain = [grad(im) for ex, _ in sample for im, k in zip(ex.images, ex.kinds) if k == "plain"]
    assert min(dense) > max(plain)
    assert np.mean(dense) > 3 * np.mean(plain)


def test_png_bytes_round_trip():
    for im in nd.make_example(7).images:
        data = nd.png_bytes(im)
        assert data[:8] == b"\x89PNG\r\n\x1a\n"
        back = Image.open(io.BytesIO(data))
        assert back.format == "PNG" and back.mode == "RGB" and back.size == im.size
        assert back.tobytes() == im.tobytes()


def check_cli(module, split: str, n: int, out) -> list[tuple[dict, object]]:
    """Run module.main for the first n examples of a split into `out` and check what it wrote (one
    jsonl line per example, in order, with its facts; its images as lossless PNGs named by seed and
    number); (row, example) pairs for the caller's own checks (tests/test_taskset_v2.py too)."""
    module.main(["--split", split, "--n", str(n), "--out", str(out)])
    rows = [json.loads(line) for line in (out / "examples.jsonl").read_text().splitlines()]
    assert [r["seed"] for r in rows] == [module.split_seed(split, i) for i in range(n)]
    pairs = [(r, module.make_example(r["seed"])) for r in rows]
    for r, ex in pairs:
        assert (r["split"], r["question"], r["answer"], r["task"], tuple(r["kinds"])) == \
            (split, ex.question, ex.answer, ex.task, ex.kinds)
        assert r["images"] == [f"{ex.seed}_{k}.png" for k in range(1, len(ex.images) + 1)]
        for name, im in zip(r["images"], ex.images):
            assert Image.open(out / name).tobytes() == im.tobytes()
    return pairs


def test_cli_writes_images_and_jsonl(tmp_path):
    for row, _ in check_cli(nd, "test", 3, tmp_path):
        assert set(row) == {"seed", "split", "task", "question", "answer", "kinds", "images"}  # nothing else


def test_describe_examples_say_what_the_asked_image_shows():
    vocab = set(nd.vocabulary())
    seen = set()
    for seed in range(60):
        ex = nd.make_describe_example(seed)
        plan = nd._plan(seed)
        i = int(re.search(r"image (\d+)", ex.question).group(1))
        note = plan.notes[i - 1]
        seen.add(note.type)
        assert ex.task == "describe" and ex.question == nd.DESCRIBE_QUESTION.format(i=i)
        assert ex.answer == nd.describe(note)
        assert set(nd.tokenize(ex.answer)) <= vocab, ex.answer
        # Same images as the task example of this seed: only the question differs.
        assert [im.tobytes() for im in ex.images] == [im.tobytes() for im in nd.make_example(seed).images]
    assert seen == {"price_tag", "receipt", "table", "shape", "solid"}
    assert nd.describe(nd._Note("receipt", items=(("K", 19), ("L", 48)))) == "K 19 L 48 TOTAL 67"
    assert nd.describe(nd._Note("price_tag", price=64)) == "$64"
    assert nd.describe(nd._Note("table", cells=(1, 5, 3, 2))) == "1 5 3 2"


def test_readings_are_the_digits_each_image_shows():
    for seed in range(40):
        plan = nd._plan(seed)
        rows = [list(r) for r in nd.make_example(seed).readings]
        assert nd.make_describe_example(seed).readings == nd.make_example(seed).readings
        assert len(rows) == len(nd.make_example(seed).images) == len(plan.notes)
        for note, row in zip(plan.notes, rows):
            assert len(row) == nd.READING_SLOTS
            digits = [d for d in row if d != nd.NO_DIGIT]
            assert row[:len(digits)] == digits  # filled from the first slot
            if note.type == "price_tag":
                assert int("".join(map(str, digits))) == note.price
            elif note.type == "receipt":
                assert int(f"{digits[0]}{digits[1]}") == note.total and len(digits) == 2 + 2 * len(note.items)
            elif note.type == "table":
                assert tuple(digits) == note.cells
            else:
                assert digits == []
