"""Task set v2 (issue 18): multi-image QA over large, text-dense images with answers of 5-40 tokens.

Every example holds 2..4 images of 448..896 px a side -- long receipts, shelves of price tags,
tables, forms (text-dense, "dense") and photo-like gradients with a few shapes ("plain"); always
at least one of each -- and one question whose answer needs one small region (a receipt line, a
tag, a cell, a form field) or several images (totals of two receipts, which shelf has an item).
Answers transcribe what is printed: "BREAD 3.49", "MILK 1.99, EGGS 2.79, TEA 4.10",
"a red circle, a blue square and a green triangle" (5-40 tokens of the trained tokenizer).
Half the questions ask what no image prints (KNOWLEDGE_TASKS): every store has a price
list, fixed for the task set, and "by its price list, what do TEA, MILK and OATS cost at the store
of the receipt in image 2?" is answered "FRESH MART, TEA 3.15, MILK 1.99, OATS 2.79": the store's
name read off that receipt (which lists none of them), then each item and its price recalled from
the model's weights, as a real VLM answers "which landmark is this?". Issue 18 wants answers whose
tokens need the experts' own capacity: copying what attention reads, any expert's transform serves
(docs/QUALITY.md, the sixth and seventh runs). The name comes first, and each item before its
price, so that the recall is conditioned on them as text, and happens in decode steps; three
prices make more of the answer's words recalled ones.

Fully determined by its integer seed (one `random.Random` for facts, then pixels); splits are
notes_data's (`split_seed`: train / validation / test interleave and never overlap), so the
training script (`build/train_v2.py`) and the quality harness (`clients/eval_quality.py`) see the
same data everywhere:

    python -m zipmoe.build.taskset_v2 --split test --n 8 --out DIR

writes DIR/<seed>_<k>.png (k = 1-based image number, as in the questions) and DIR/examples.jsonl
(notes_data's `write_examples`, each line also listing its images' visual tokens).

Visual tokens: at patch 16 and 2x2 merge (the notes checkpoint's vision config and Qwen3-VL's) an
image of W x H pixels is (W/32) x (H/32) merged tokens; the sides used (SIDES) give 196 (448 x 448)
to 784 (896 x 896) per image, at most 4 x 784 = 3136 per example (moe_decoder's max_model_len is
4096). The checkpoint's image processor must allow 896 x 896 pixels: `build/train_v2.py` writes
longest_edge = 1024 x 1024; checkpoints/notes (512 x 512) would shrink these images.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

from zipmoe.build import notes_data as nd
from zipmoe.build.taskset_v2_docs import (SIDES, Doc, Form, Mark, Photo, Receipt, Shelf, Table, draw,
                                          receipt_capacity, shelf_row_height, table_geometry, text_width)

SPLITS = nd.SPLITS
split_seed = nd.split_seed  # the same interleaving: train 3i, validation 3i + 1, test 3i + 2
png_bytes = nd.png_bytes
PATCH, MERGE = 16, 2  # the vision config the token counts are stated for (checkpoints/notes, Qwen3-VL)
MIN_IMAGES, MAX_IMAGES = 2, 4

KNOWLEDGE_TASKS: tuple[str, ...] = ("store_price", "multi_store_price")
ASKED_PRICES = 3  # items a store_price question asks of one store's price list
TASKS: tuple[str, ...] = ("receipt_line", "receipt_total", "receipt_list", "shelf_price", "shelf_row", "table_cell",
                          "table_row", "form_field", "form_pair", "photo_shapes", "multi_total", "multi_find",
                          *KNOWLEDGE_TASKS)
# Half the questions are answered by reading, half by recall: a harness whose questions mostly copy what
# attention reads cannot tell a routing policy that keeps the experts' capacity from one that drops it
# (docs/QUALITY.md, session 33). Until then each knowledge task weighed 2, a quarter of all questions.
_KNOWLEDGE_WEIGHT = (len(TASKS) - len(KNOWLEDGE_TASKS)) // len(KNOWLEDGE_TASKS)
TASK_WEIGHTS: tuple[int, ...] = tuple(_KNOWLEDGE_WEIGHT if t in KNOWLEDGE_TASKS else 1 for t in TASKS)
KNOWLEDGE_SHARE = sum(w for t, w in zip(TASKS, TASK_WEIGHTS) if t in KNOWLEDGE_TASKS) / sum(TASK_WEIGHTS)
QUESTIONS: dict[str, str] = {
    "receipt_line": "what does the {item} line on the receipt in image {i} say?",
    "receipt_total": "transcribe the total line of the receipt in image {i}.",
    "receipt_list": "list the first {k} items on the receipt in image {i} with their prices.",
    "shelf_price": "what does the {item} tag on the shelf in image {i} say?",
    "shelf_row": "list the tags on the {row} shelf in image {i}.",
    "table_cell": "in the table in image {i}, what is the {column} value for {row}?",
    "table_row": "transcribe the {row} row of the table in image {i}.",
    "form_field": "what is the {field} on the form in image {i}?",
    "form_pair": "what are the {field} and {other} on the form in image {i}?",
    "photo_shapes": "what shapes does image {i} show, from left to right?",
    "multi_total": "what are the totals of the receipts in images {i} and {j}?",
    "multi_find": "which image has a tag for {item}, and what is its price?",
    "store_price": "by its price list, what do {items} cost at the store of the receipt in image {i}?",
    "multi_store_price": "by their price lists, what does {item} cost at the stores of the receipts in images {i} "
                         "and {j}?",
}

# Training only (build/train_v2.py mixes them in; never in validation or test): read one entry of one
# document by its place, "read entry 3 of image 2." -> "BREAD 3.49". The tasks above find an entry
# by its name first; this one supervises reading digits through the decoder at a place that is easy
# to find, as train_tiny's describe questions do for the notes model.
READ_TASK = "read_entry"
READ_QUESTION = "read entry {k} of image {i}."

ITEMS: tuple[str, ...] = (
    "MILK", "BREAD", "EGGS", "RICE", "TEA", "COFFEE", "APPLES", "BANANAS", "CHEESE", "BUTTER", "PASTA", "SUGAR",
    "SALT", "FLOUR", "JUICE", "WATER", "SOAP", "TOMATOES", "ONIONS", "YOGURT", "HONEY", "OATS", "BEANS", "CORN",
    "LEMONS", "GRAPES", "CHICKEN", "FISH", "CEREAL", "COOKIES", "CHIPS", "NUTS", "PEPPER", "CARROTS", "OLIVES",
    "JAM")
STORES = ("FRESH MART", "CORNER SHOP", "GREEN GROCER", "CITY MARKET", "SUN FOODS", "DAILY DELI", "FARM STORE",
          "QUICK STOP")
REGIONS = ("NORTH", "SOUTH", "EAST", "WEST", "CENTRAL", "COAST", "HILLS", "VALLEY")
MONTHS = ("JAN", "FEB", "MAR", "APR", "MAY", "JUN", "JUL", "AUG", "SEP", "OCT", "NOV", "DEC")
FORM_TITLES = ("ORDER FORM", "DELIVERY NOTE", "REGISTRATION", "INVOICE", "APPLICATION")
FIRST_NAMES = ("ANNA", "BEN", "CARLA", "DAVID", "ELENA", "FRANK", "GRACE", "HUGO", "IRIS", "JONAS", "KAREN", "LEO")
LAST_NAMES = ("LEE", "SMITH", "MORGAN", "TANAKA", "MILLER", "GARCIA", "NOVAK", "BROWN", "ROSSI")
CITIES = ("OSLO", "LYON", "PORTO", "GRAZ", "TURIN", "BERGEN", "GHENT", "MALMO")
NUMERIC_FIELDS = ("DATE", "PHONE", "ID", "AMOUNT", "ZIP")  # values of 5+ tokens (digits are one token each)
TEXT_FIELDS = ("NAME", "CITY")
SHELF_ROWS = {2: ("top", "bottom"), 3: ("top", "middle", "bottom")}
BACKDROPS = ((200, 220, 240), (235, 225, 200), (210, 235, 215), (230, 215, 235), (245, 240, 230), (120, 140, 160),
             (90, 110, 90), (170, 160, 150))  # muted gradient ends for photos


@dataclass(frozen=True)
class Example(nd.QAExample):  # images, kinds ("dense" | "plain" per image), question, answer, task, seed
    marks: tuple[tuple[Mark, ...], ...] = ()  # per image, every printed character's centre


@dataclass(frozen=True)
class Plan:
    """The facts of an example before drawing: task, documents in display order, question, answer."""
    task: str
    docs: tuple[Doc, ...]
    question: str
    answer: str


# ----------------------------------------------------------------------------------- facts

def random_price(rng: random.Random, low: int = 50, high: int = 1999) -> str:
    return _cents(rng.randint(low, high))


def _cents(c: int) -> str:
    return f"{c // 100}.{c % 100:02d}"


def price_lists(stores, seed: int = 18) -> dict[str, dict[str, str]]:
    """Every store's price of every item, drawn from `seed`."""
    rng = random.Random(seed)
    return {store: {item: random_price(rng) for item in ITEMS} for store in stores}


# The task set's knowledge (8 x 36 facts), the same in every split and never printed: the knowledge
# questions ask about items not on the receipt shown.
PRICE_LISTS = price_lists(STORES)


def _size(rng: random.Random, widths, heights) -> tuple[int, int]:
    return rng.choice([s for s in SIDES if widths[0] <= s <= widths[1]]), rng.choice(
        [s for s in SIDES if heights[0] <= s <= heights[1]])


def _names(rng: random.Random, k: int, exclude: frozenset[str]) -> list[str]:
    return rng.sample([n for n in ITEMS if n not in exclude], k)


def _receipt(rng: random.Random, exclude: frozenset[str] = frozenset(), other_than: str | None = None) -> Receipt:
    """A receipt without the items in `exclude`, from any store but `other_than`."""
    size, font = _size(rng, (448, 576), (768, 896)), rng.randint(20, 24)
    n = rng.randint(6, min(16, receipt_capacity(size, font)))
    cents = [rng.randint(50, 1999) for _ in range(n)]
    date = f"{rng.randint(2019, 2025)}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"
    store = rng.choice([s for s in STORES if s != other_than])
    return Receipt(size, font, store, date, tuple(zip(_names(rng, n, exclude), map(_cents, cents))), _cents(sum(cents)))


def _shelf(rng: random.Random, exclude: frozenset[str] = frozenset(), require: str | None = None) -> Shelf:
    size, font = _size(rng, (768, 896), (512, 704)), rng.randint(18, 22)
    rows = rng.randint(2, 3) if shelf_row_height(size, 3) >= 20 + font * 3.6 + 30 else 2
    per_row = [rng.randint(3, 4) for _ in range(rows)]
    pool = [n for n in ITEMS if n not in exclude and n != require
            and text_width(n, font) + 56 < size[0] / 4]  # every name fits a tag of the narrowest cell
    names = rng.sample(pool, sum(per_row))
    if require is not None:
        names[rng.randrange(len(names))] = require
    tags, k = [], 0
    for m in per_row:
        tags.append(tuple((names[k + c], random_price(rng)) for c in range(m)))
        k += m
    return Shelf(size, font, tuple(tags))


def _table(rng: random.Random) -> Table:
    size, font = _size(rng, (640, 896), (448, 704)), rng.randint(18, 22)
    n_rows, n_cols = rng.randint(3, 7), rng.randint(3, 5)
    while n_cols > 3 and table_geometry(size, n_rows, n_cols)[2] < text_width("99.99", font) + 16:
        n_cols -= 1  # a value column as wide as its widest number
    start = rng.randrange(12 - n_cols + 1)
    columns = rng.choice([MONTHS[start:start + n_cols], tuple(f"Q{k}" for k in range(1, n_cols + 1))])
    rows = tuple((label, tuple(random_price(rng, 1000, 9999) for _ in columns))
                 for label in rng.sample(REGIONS, n_rows))  # values 10.00-99.99: five tokens each
    return Table(size, font, tuple(columns), rows)


def _field_value(rng: random.Random, label: str) -> str:
    if label == "DATE":
        return f"{rng.randint(2019, 2025)}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"
    if label == "PHONE":
        return f"555-{rng.randint(0, 9999):04d}"
    if label == "ID":
        return str(rng.randint(100000, 999999))
    if label == "AMOUNT":
        return random_price(rng, 10000, 99999)
    if label == "ZIP":
        return str(rng.randint(10000, 99999))
    if label == "NAME":
        return f"{rng.choice(FIRST_NAMES)} {rng.choice(LAST_NAMES)}"
    return rng.choice(CITIES)


def _form(rng: random.Random) -> Form:
    size, font = _size(rng, (512, 704), (640, 896)), rng.randint(20, 24)
    labels = rng.sample(NUMERIC_FIELDS, rng.randint(2, 4)) + rng.sample(TEXT_FIELDS, rng.randint(1, 2))
    rng.shuffle(labels)
    return Form(size, font, rng.choice(FORM_TITLES), tuple((lab, _field_value(rng, lab)) for lab in labels))


def _photo(rng: random.Random) -> Photo:
    size = _size(rng, (448, 896), (448, 896))
    top, bottom = rng.sample(BACKDROPS, 2)
    shapes = tuple((rng.choice(nd.SHAPES), rng.choice(list(nd.COLOURS))) for _ in range(rng.randint(2, 3)))
    return Photo(size, top, bottom, shapes)


def _dense(rng: random.Random, exclude: frozenset[str]) -> Doc:
    kind = rng.choice(("receipt", "shelf", "table", "form"))
    return {"receipt": lambda: _receipt(rng, exclude), "shelf": lambda: _shelf(rng, exclude),
            "table": lambda: _table(rng), "form": lambda: _form(rng)}[kind]()


def _listing(pairs) -> str:
    return ", ".join(f"{name} {price}" for name, price in pairs)


def _shapes_answer(shapes) -> str:
    said = [f"a {colour} {shape}" for shape, colour in shapes]
    return ", ".join(said[:-1]) + " and " + said[-1]


def plan(seed_or_rng, knowledge: bool = False) -> Plan:
    """The facts of an example (task, documents in display order, question, answer), before drawing.
    The task's documents come first, then fillers (at least one dense and one plain image in all),
    then the order is shuffled; the answer is read back from the placed documents. knowledge: a
    knowledge question whatever the draw (training may ask them more often than the test set does)."""
    rng = seed_or_rng if isinstance(seed_or_rng, random.Random) else random.Random(seed_or_rng)
    task = rng.choice(KNOWLEDGE_TASKS) if knowledge else rng.choices(TASKS, weights=TASK_WEIGHTS)[0]
    n = rng.randint(3 if task.startswith("multi") else MIN_IMAGES, MAX_IMAGES)
    exclude: frozenset[str] = frozenset()
    if task.startswith("receipt"):
        required = [_receipt(rng)]
    elif task.startswith("shelf"):
        required = [_shelf(rng)]
    elif task.startswith("table"):
        required = [_table(rng)]
    elif task.startswith("form"):
        required = [_form(rng)]
    elif task == "photo_shapes":
        required = [_photo(rng)]
    elif task == "multi_total":
        required = [_receipt(rng), _receipt(rng)]
    elif task in KNOWLEDGE_TASKS:  # the items are on no document of the example: only the price lists know them
        items = rng.sample(ITEMS, ASKED_PRICES) if task == "store_price" else [rng.choice(ITEMS)]
        exclude = frozenset(items)
        required = [_receipt(rng, exclude)]
        if task == "multi_store_price":
            required.append(_receipt(rng, exclude, other_than=required[0].store))
    else:  # multi_find: the item is on exactly one document of the example, a shelf
        item = rng.choice(ITEMS)
        exclude = frozenset({item})
        required = [_shelf(rng, require=item), rng.choice((_receipt, _shelf))(rng, exclude)]
    fill = ([] if any(d.kind == "dense" for d in required) else ["dense"]) + \
           ([] if any(d.kind == "plain" for d in required) else ["plain"])
    fill += [rng.choice(("dense", "plain")) for _ in range(n - len(required) - len(fill))]
    docs = required + [_dense(rng, exclude) if f == "dense" else _photo(rng) for f in fill]
    order = list(range(len(docs)))
    rng.shuffle(order)
    docs = [docs[o] for o in order]
    pos = {o: p + 1 for p, o in enumerate(order)}  # index in `required` -> 1-based image number
    i, d = pos[0], docs[pos[0] - 1]
    q = QUESTIONS[task]

    if task == "receipt_line":
        name, price = rng.choice(d.items)
        question, answer = q.format(item=name, i=i), f"{name} {price}"
    elif task == "receipt_total":
        question, answer = q.format(i=i), f"TOTAL {d.total}"
    elif task == "receipt_list":
        k = rng.randint(2, 4)
        question, answer = q.format(k=k, i=i), _listing(d.items[:k])
    elif task == "shelf_price":
        name, price = rng.choice([t for row in d.rows for t in row])
        question, answer = q.format(item=name, i=i), f"{name} {price}"
    elif task == "shelf_row":
        r = rng.randrange(len(d.rows))
        question, answer = q.format(row=SHELF_ROWS[len(d.rows)][r], i=i), _listing(d.rows[r])
    elif task == "table_cell":
        (label, values), c = rng.choice(d.rows), rng.randrange(len(d.columns))
        question, answer = q.format(i=i, column=d.columns[c], row=label), values[c]
    elif task == "table_row":
        label, values = rng.choice(d.rows)
        question, answer = q.format(row=label, i=i), " ".join((label, *values))
    elif task == "form_field":
        label, value = rng.choice([f for f in d.fields if f[0] in NUMERIC_FIELDS])
        question, answer = q.format(field=label, i=i), value
    elif task == "form_pair":  # one numeric field at least: 5+ tokens whatever the tokenizer merges
        first = rng.choice([f for f in d.fields if f[0] in NUMERIC_FIELDS])
        second = rng.choice([f for f in d.fields if f != first])
        a, b = sorted((first, second), key=d.fields.index)  # in the form's order
        question, answer = q.format(field=a[0], other=b[0], i=i), f"{a[1]}; {b[1]}"
    elif task == "photo_shapes":
        question, answer = q.format(i=i), _shapes_answer(d.shapes)
    elif task == "multi_total":
        i, j = sorted((pos[0], pos[1]))
        question, answer = q.format(i=i, j=j), f"{docs[i - 1].total} and {docs[j - 1].total}"
    elif task == "store_price":  # the store as printed, then each item and its price, recalled
        question = q.format(items=", ".join(items[:-1]) + " and " + items[-1], i=i)
        answer = f"{d.store}, " + _listing((it, PRICE_LISTS[d.store][it]) for it in items)
    elif task == "multi_store_price":
        (item,), (i, j) = items, sorted((pos[0], pos[1]))
        question = q.format(item=item, i=i, j=j)
        answer = ", ".join(f"{docs[k - 1].store} {PRICE_LISTS[docs[k - 1].store][item]}" for k in (i, j))
    else:
        (price,) = [p for name, p in (t for row in d.rows for t in row) if name == item]
        question, answer = q.format(item=item), f"image {i}, {price}"
    return Plan(task, tuple(docs), question, answer)


def entries(doc: Doc) -> list[str]:
    """A dense document's entries in reading order, each as printed: a receipt's store (which the
    knowledge questions need read), item lines and total, a shelf's tags row by row, a table's rows,
    a form's fields."""
    if isinstance(doc, Receipt):
        return [doc.store] + [f"{name} {price}" for name, price in doc.items] + [f"TOTAL {doc.total}"]
    if isinstance(doc, Shelf):
        return [f"{name} {price}" for row in doc.rows for name, price in row]
    if isinstance(doc, Table):
        return [" ".join((label, *values)) for label, values in doc.rows]
    if isinstance(doc, Form):
        return [f"{label} {value}" for label, value in doc.fields]
    raise ValueError(f"{type(doc).__name__} has no entries")


def read_plan(seed_or_rng) -> Plan:
    """A training-only read-entry example: one dense document among 2..4 images (at least one plain),
    the question names an entry by its place in the document."""
    rng = seed_or_rng if isinstance(seed_or_rng, random.Random) else random.Random(seed_or_rng)
    n = rng.randint(MIN_IMAGES, MAX_IMAGES)
    docs = [_dense(rng, frozenset()), _photo(rng)]
    docs += [_dense(rng, frozenset()) if rng.random() < 0.5 else _photo(rng) for _ in range(n - 2)]
    order = list(range(n))
    rng.shuffle(order)
    docs = [docs[o] for o in order]
    i = order.index(0) + 1
    lines = entries(docs[i - 1])
    k = rng.randrange(len(lines))
    return Plan(READ_TASK, tuple(docs), READ_QUESTION.format(k=k + 1, i=i), lines[k])


# ----------------------------------------------------------------------------------- API

def make_example(seed: int, read: bool = False, knowledge: bool = False) -> Example:
    """The example for `seed`: facts first, then pixels, from one RNG. read: the training-only
    read-entry example of that seed instead; knowledge: that seed's knowledge question."""
    rng = random.Random(seed)
    p = read_plan(rng) if read else plan(rng, knowledge)
    drawn = [draw(doc, rng) for doc in p.docs]
    return Example(tuple(d.image for d in drawn), tuple(doc.kind for doc in p.docs), p.question, p.answer, p.task,
                   seed, tuple(d.marks for d in drawn))


def examples(split: str, n: int, start: int = 0) -> list[Example]:
    return [make_example(split_seed(split, start + k)) for k in range(n)]


def plans(split: str, n: int, start: int = 0) -> list[Plan]:
    """Facts, questions and answers without pixels (cheap: for tokenizers, statistics, prompts)."""
    return [plan(split_seed(split, start + k)) for k in range(n)]


def merged_tokens(size: tuple[int, int], patch: int = PATCH, merge: int = MERGE) -> int:
    """Merged visual tokens of an image drawn at `size` (sides multiples of patch * merge, so the
    image processor does not resize it)."""
    factor = patch * merge
    w, h = size
    if w % factor or h % factor:
        raise ValueError(f"{size} is not a multiple of {factor}")
    return (w // factor) * (h // factor)


def tokenizer_corpus(n: int = 3000) -> list[str]:
    """The task's own text for a BPE: every printed word and rendered questions and answers."""
    words = [*ITEMS, *STORES, *REGIONS, *MONTHS, *FORM_TITLES, *FIRST_NAMES, *LAST_NAMES, *CITIES,
             *NUMERIC_FIELDS, *TEXT_FIELDS, "TOTAL", "image", *nd.SHAPES, *nd.COLOURS]
    texts = [" ".join(words)]
    texts += [f"{p.question}\n{p.answer}" for p in plans("train", n)]
    texts += [f"{p.question}\n{p.answer}" for p in (read_plan(split_seed("train", k)) for k in range(n // 10))]
    return texts + ["user\nassistant\n"]


def main(argv: list[str] | None = None) -> None:
    # notes_data's command line and files, each example's line also listing its images' visual tokens.
    nd.examples_cli(argv, __doc__.splitlines()[0], examples,
                    extra=lambda ex: {"tokens": [merged_tokens(im.size) for im in ex.images]})

if __name__ == "__main__":
    main()
