"""Deterministic synthetic multi-image QA examples over note-like images.

Every example holds 2..5 small RGB images -- always at least one detail-dense
note (price tag, receipt, table) and at least one plain one (coloured shape,
solid colour) -- and one English question with a short exact answer. It is
fully determined by its integer seed, so the tiny-model training script and the
accuracy harness see the same data everywhere:

    python -m zipmoe.build.notes_data --split test --n 8 --out DIR

writes DIR/<seed>_<k>.png (k = 1-based image number, as in the questions) and
DIR/examples.jsonl for humans to look at.

The facts of each image and the question are planned here; `build/notes_drawing.py` draws them.
"""

from __future__ import annotations

import argparse
import io
import json
import random
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from PIL import Image

from zipmoe.build.notes_drawing import COLOURS, IMAGE_SIZE, render

TASKS: tuple[str, ...] = ("read_price", "read_total", "find", "count", "compare", "colour")
SPLITS: tuple[str, ...] = ("train", "validation", "test")

MIN_IMAGES, MAX_IMAGES = 2, 5
PRICE_RANGE = (10, 99)
SHAPES: tuple[str, ...] = ("circle", "square", "triangle")
_DENSE_TYPES = (("price_tag", 2), ("receipt", 2), ("table", 1))  # (type, weight)
_PLAIN_TYPES = (("shape", 3), ("solid", 2))
_RECEIPT_LETTERS = "ABCDEFGHJKLMNPRSTUVWXYZ"

QUESTIONS: dict[str, str] = {
    "read_price": "what is the price in image {i}?",
    "read_total": "what is the total on the receipt?",
    "find": "which image shows a {colour} {shape}?",
    "count": "how many images show a {shape}?",
    "compare": "which image has the higher price, {i} or {j}?",
    "colour": "what colour is the shape in image {i}?",
}

# Training only: say what one image shows (a price, a receipt's lines, a table's cells, a shape).
# Like the OCR and caption data real VLMs learn from, it supervises every image's content through
# the decoder, where the six tasks give a reading signal only on a quarter of the images.
DESCRIBE_QUESTION = "what does image {i} show?"

__all__ = [
    "IMAGE_SIZE", "TASKS", "SPLITS", "SHAPES", "COLOURS", "QUESTIONS", "DESCRIBE_QUESTION", "Example",
    "make_example", "make_describe_example", "describe", "READING_SLOTS", "NO_DIGIT",
    "split_seed", "examples", "png_bytes", "vocabulary", "tokenize", "QAExample", "write_examples", "examples_cli",
]


@dataclass(frozen=True)
class QAExample:
    """A multi-image question and its answer: what write_examples needs (build/taskset_v2.py's
    examples are QAExamples too)."""
    images: tuple[Image.Image, ...]
    kinds: tuple[str, ...]  # "dense" | "plain", one per image
    question: str
    answer: str
    task: str
    seed: int


@dataclass(frozen=True)
class Example(QAExample):
    readings: tuple[tuple[int, ...], ...] = ()  # per image, the digits it shows (see _readings)


# ----------------------------------------------------------------------------- facts


@dataclass(frozen=True)
class _Note:
    """What one image shows: the facts answers are derived from (drawn exactly)."""

    type: str  # price_tag | receipt | table | shape | solid
    price: int | None = None
    items: tuple[tuple[str, int], ...] = ()
    cells: tuple[int, ...] = ()
    shape: str | None = None
    colour: str | None = None

    @property
    def kind(self) -> str:
        return "dense" if self.type in ("price_tag", "receipt", "table") else "plain"

    @property
    def total(self) -> int | None:
        return sum(v for _, v in self.items) if self.type == "receipt" else None


@dataclass(frozen=True)
class _Plan:
    task: str
    notes: tuple[_Note, ...]
    question: str
    answer: str


def _weighted(rng: random.Random, table) -> str:
    names, weights = zip(*table)
    return rng.choices(names, weights=weights)[0]


def _price_tag(rng: random.Random, exclude: tuple[int, ...] = ()) -> _Note:
    price = rng.choice([p for p in range(PRICE_RANGE[0], PRICE_RANGE[1] + 1) if p not in exclude])
    return _Note("price_tag", price=price)


def _receipt(rng: random.Random) -> _Note:
    n = rng.randint(2, 3)
    hi = 49 if n == 2 else 33  # two-digit items, total <= 99
    letters = rng.sample(_RECEIPT_LETTERS, n)
    return _Note("receipt", items=tuple((c, rng.randint(10, hi)) for c in letters))


def _dense(rng: random.Random, allowed: tuple[str, ...]) -> _Note:
    kind = _weighted(rng, [t for t in _DENSE_TYPES if t[0] in allowed])
    if kind == "price_tag":
        return _price_tag(rng)
    if kind == "receipt":
        return _receipt(rng)
    return _Note("table", cells=tuple(rng.randint(1, 9) for _ in range(4)))


def _plain(rng: random.Random, forbid_shape=lambda shape, colour: False) -> _Note:
    while True:  # rejection keeps the remaining combinations uniform; always terminates
        if _weighted(rng, _PLAIN_TYPES) == "solid":
            return _Note("solid", colour=rng.choice(list(COLOURS)))
        shape, colour = rng.choice(SHAPES), rng.choice(list(COLOURS))
        if not forbid_shape(shape, colour):
            return _Note("shape", shape=shape, colour=colour)


def _plan(rng_or_seed) -> _Plan:
    """The facts of an example (task, notes in display order, question, answer), before drawing.

    Answers are read back from the placed notes, never carried over from the sampling."""
    rng = rng_or_seed if isinstance(rng_or_seed, random.Random) else random.Random(rng_or_seed)
    task = rng.choice(TASKS)
    n = rng.randint(3 if task == "compare" else MIN_IMAGES, MAX_IMAGES)
    dense_ok = ("price_tag", "receipt", "table")
    forbid = lambda shape, colour: False  # noqa: E731
    required: list[_Note] = []
    target_shape = None
    if task == "read_price":
        required = [_price_tag(rng)]
    elif task == "compare":
        a = _price_tag(rng)
        required = [a, _price_tag(rng, exclude=(a.price,))]
    elif task == "read_total":
        required = [_receipt(rng)]
        dense_ok = ("price_tag", "table")  # exactly one receipt
    elif task in ("find", "colour"):
        required = [_Note("shape", shape=rng.choice(SHAPES), colour=rng.choice(list(COLOURS)))]
        if task == "find":  # exactly one image shows this colour and shape
            t = required[0]
            forbid = lambda shape, colour: (shape, colour) == (t.shape, t.colour)  # noqa: E731
    elif task == "count":
        target_shape = rng.choice(SHAPES)
        k = rng.randint(0, n - 1)  # at least one slot stays dense
        required = [_Note("shape", shape=target_shape, colour=rng.choice(list(COLOURS))) for _ in range(k)]
        forbid = lambda shape, colour: shape == target_shape  # noqa: E731

    kinds = [r.kind for r in required]
    fill = []
    if "dense" not in kinds:
        fill.append("dense")
    if "plain" not in kinds:
        fill.append("plain")
    fill += [rng.choice(("dense", "plain")) for _ in range(n - len(required) - len(fill))]
    notes = required + [_dense(rng, dense_ok) if f == "dense" else _plain(rng, forbid) for f in fill]
    order = list(range(n))
    rng.shuffle(order)
    notes = [notes[o] for o in order]
    pos = {o: p + 1 for p, o in enumerate(order)}  # index in `required` -> 1-based image number

    if task == "read_price":
        i = pos[0]
        q, a = QUESTIONS[task].format(i=i), str(notes[i - 1].price)
    elif task == "compare":
        i, j = sorted((pos[0], pos[1]))
        a = i if notes[i - 1].price > notes[j - 1].price else j
        q, a = QUESTIONS[task].format(i=i, j=j), str(a)
    elif task == "read_total":
        (r,) = [x for x in notes if x.type == "receipt"]
        q, a = QUESTIONS[task], str(r.total)
    elif task == "find":
        t = required[0]
        (i,) = [p + 1 for p, x in enumerate(notes) if (x.type, x.shape, x.colour) == ("shape", t.shape, t.colour)]
        q, a = QUESTIONS[task].format(colour=t.colour, shape=t.shape), str(i)
    elif task == "colour":
        i = pos[0]
        q, a = QUESTIONS[task].format(i=i), notes[i - 1].colour
    else:  # count
        a = sum(x.type == "shape" and x.shape == target_shape for x in notes)
        q, a = QUESTIONS[task].format(shape=target_shape), str(a)
    return _Plan(task, tuple(notes), q, a)


# ----------------------------------------------------------------------------- API


def _draw(seed: int) -> tuple[random.Random, _Plan, tuple[Image.Image, ...]]:
    """One RNG for the example of `seed`: facts first, then pixels."""
    rng = random.Random(seed)
    plan = _plan(rng)
    return rng, plan, tuple(render(note, rng) for note in plan.notes)


READING_SLOTS = 8  # digits an image can hold: a receipt's total and up to three items (2 each)
NO_DIGIT = -100  # cross_entropy's ignore_index


def _readings(note: _Note) -> tuple[int, ...]:
    """The digits `note` shows in READING_SLOTS slots (NO_DIGIT where none): a price's two digits; a
    receipt's total, then each item's two digits; a table's four cells. Plain images show none."""
    if note.type == "price_tag":
        digits = [note.price // 10, note.price % 10]
    elif note.type == "receipt":
        digits = [d for v in (note.total, *(value for _, value in note.items)) for d in (v // 10, v % 10)]
    elif note.type == "table":
        digits = list(note.cells)
    else:
        digits = []
    return tuple(digits + [NO_DIGIT] * (READING_SLOTS - len(digits)))


def _example(plan: _Plan, images, question: str, answer: str, task: str, seed: int) -> Example:
    return Example(images, tuple(n.kind for n in plan.notes), question, answer, task, seed,
                   tuple(_readings(n) for n in plan.notes))


def make_example(seed: int) -> Example:
    """The example for `seed`: task drawn uniformly from TASKS, then facts, then pixels (one RNG)."""
    _, plan, images = _draw(seed)
    return _example(plan, images, plan.question, plan.answer, plan.task, seed)


def describe(note: _Note) -> str:
    """The answer to DESCRIBE_QUESTION: the image's text as written, or its colour and shape."""
    if note.type == "price_tag":
        return f"${note.price}"
    if note.type == "receipt":
        return " ".join(f"{label} {value:02d}" for label, value in note.items) + f" TOTAL {note.total:02d}"
    if note.type == "table":
        return " ".join(str(v) for v in note.cells)
    if note.type == "shape":
        return f"a {note.colour} {note.shape}"
    return f"solid {note.colour}"


def make_describe_example(seed: int) -> Example:
    """The images of make_example(seed), asked what one of them (drawn after the pixels) shows."""
    rng, plan, images = _draw(seed)
    i = rng.randint(1, len(plan.notes))
    return _example(plan, images, DESCRIBE_QUESTION.format(i=i), describe(plan.notes[i - 1]), "describe", seed)


def split_seed(split: str, index: int) -> int:
    """Seed of example `index` of a split; splits interleave (3*index + 0|1|2) and never overlap."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if index < 0:
        raise ValueError(f"index must be >= 0, got {index}")
    return 3 * index + SPLITS.index(split)


def examples(split: str, n: int, start: int = 0) -> list[Example]:
    return [make_example(split_seed(split, start + k)) for k in range(n)]


def png_bytes(image: Image.Image) -> bytes:
    """Lossless PNG encoding (what clients send to the server)."""
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


_TOKEN = re.compile(r"[a-z]+|[0-9]+|[^\sa-z0-9]")


def tokenize(text: str) -> list[str]:
    """Split a question or answer into vocabulary() tokens: words, whole numbers, punctuation."""
    return _TOKEN.findall(text)


def vocabulary() -> list[str]:
    """Every token that can appear in questions and answers (describe's too), sorted (numbers 0..99
    as whole tokens)."""
    words = set(COLOURS) | set(SHAPES) | {str(v) for v in range(100)}
    words.update(tokenize(f"a solid $ TOTAL {' '.join(_RECEIPT_LETTERS)}"))  # describe's answers
    for template in (*QUESTIONS.values(), DESCRIBE_QUESTION):
        words.update(tokenize(re.sub(r"\{\w+\}", " ", template)))
    return sorted(words)


def write_examples(out: Path, split: str, exs: Iterable[QAExample],
                   extra: Callable[[Any], dict] | None = None) -> None:
    """Write out/<seed>_<k>.png for every image (k = 1-based image number, as in the questions) and one
    out/examples.jsonl line per example: seed, split, task, question, answer, kinds, image file names,
    then the fields extra(ex) adds (build/taskset_v2.py: each image's visual tokens)."""
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "examples.jsonl", "w") as f:
        for ex in exs:
            names = []
            for k, img in enumerate(ex.images, start=1):
                names.append(f"{ex.seed}_{k}.png")
                (out / names[-1]).write_bytes(png_bytes(img))
            f.write(json.dumps({"seed": ex.seed, "split": split, "task": ex.task, "question": ex.question,
                                "answer": ex.answer, "kinds": list(ex.kinds), "images": names,
                                **(extra(ex) if extra is not None else {})}) + "\n")


def examples_cli(argv: list[str] | None, description: str,
                 make_examples: Callable[[str, int, int], Iterable[QAExample]],
                 extra: Callable[[Any], dict] | None = None) -> None:
    """`--split S --n N [--start K] --out DIR`: write_examples of make_examples(S, N, K) to DIR.
    This module's command line, and task set v2's (same splits, its own examples)."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--split", default="test", choices=SPLITS)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--start", type=int, default=0)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    write_examples(args.out, args.split, make_examples(args.split, args.n, args.start), extra)
    print(f"wrote {args.n} examples to {args.out}")


def main(argv: list[str] | None = None) -> None:
    examples_cli(argv, __doc__.splitlines()[0], examples)


if __name__ == "__main__":
    main()
