"""Task set v2's documents: the facts one image shows, and how they are drawn.

`build/taskset_v2.py` decides the facts of every image of an example (a `Receipt`, `Shelf`, `Table`,
`Form` or `Photo`, each with its pixel size and font size) from the example's seed, then calls
`draw(doc, rng)` with the same RNG for the pixels. What comes back is a PIL RGB image plus the
centre of every character drawn (`Mark`), from which `build/train_v2.py` labels each merged
visual token with the characters it covers (its per-token reading head). Answers never come from
the pixels: they are read from the facts.

Image sides are multiples of 64 between 448 and 896, so Qwen's smart resize (factor 32 =
patch 16 x merge 2) leaves every image as drawn when the checkpoint allows 896 x 896 pixels;
the text and placement helpers (Pillow's bundled TrueType font, ink and paper colours) are
notes_data's.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

from PIL import Image, ImageDraw

from zipmoe.build import notes_drawing as drawing

SIDES: tuple[int, ...] = tuple(range(448, 897, 64))  # 448 .. 896: few distinct sizes, so training
# can batch the vision attention of equal-length images (build/train_v2.py)
CHARSET = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ.,:;-$/"  # every character any document prints


@dataclass(frozen=True)
class Mark:
    """One printed character: its ink centre in pixels."""
    x: float
    y: float
    char: str


@dataclass(frozen=True)
class Receipt:
    size: tuple[int, int]  # (width, height)
    font: int
    store: str
    date: str
    items: tuple[tuple[str, str], ...]  # (name, price) in printed order
    total: str
    kind = "dense"


@dataclass(frozen=True)
class Shelf:
    size: tuple[int, int]
    font: int  # the item names'; prices are printed at twice this
    rows: tuple[tuple[tuple[str, str], ...], ...]  # top shelf first; each (name, price) left to right
    kind = "dense"


@dataclass(frozen=True)
class Table:
    size: tuple[int, int]
    font: int
    columns: tuple[str, ...]  # headers of the value columns
    rows: tuple[tuple[str, tuple[str, ...]], ...]  # (row label, values)
    kind = "dense"


@dataclass(frozen=True)
class Form:
    size: tuple[int, int]
    font: int
    title: str
    fields: tuple[tuple[str, str], ...]  # (label, value) top to bottom
    kind = "dense"


@dataclass(frozen=True)
class Photo:
    size: tuple[int, int]
    top: tuple[int, int, int]  # gradient colours, top to bottom
    bottom: tuple[int, int, int]
    shapes: tuple[tuple[str, str], ...]  # (shape, colour) left to right
    kind = "plain"


Doc = Receipt | Shelf | Table | Form | Photo


@dataclass(frozen=True)
class Drawn:
    image: Image.Image
    marks: tuple[Mark, ...]


def _write(draw: ImageDraw.ImageDraw, marks: list[Mark], xy, text: str, size: int, fill, anchor: str) -> None:
    """notes_data's `_text` (ink box placed by `anchor`), plus a Mark per non-space character. The
    placement arithmetic repeats `_text`'s so the marks land where it drew."""
    font = drawing.load_font(size)
    drawing.draw_text(draw, xy, text, font, fill, anchor)
    x0, y0, x1, y1 = font.getbbox(text)
    left = round(xy[0] - {"l": x0, "m": (x0 + x1) / 2, "r": x1}[anchor[0]])
    top = round(xy[1] - {"t": y0, "m": (y0 + y1) / 2, "b": y1}[anchor[1]])
    for k, ch in enumerate(text):
        if ch != " ":
            cx0, cy0, cx1, cy1 = font.getbbox(ch)
            marks.append(Mark(left + font.getlength(text[:k]) + (cx0 + cx1) / 2, top + (cy0 + cy1) / 2, ch))


def text_width(text: str, size: int) -> float:
    """Ink width of `text` in the documents' font at `size` px (for layout while planning)."""
    return drawing.ink_width(drawing.load_font(size), text)


def _dashes(draw, x0: float, x1: float, y: float, ink, width: int) -> None:
    for x in range(round(x0), round(x1), 10):
        draw.line((x, y, x + 5, y), fill=ink, width=width)


# ----------------------------------------------------------------------------------- layouts
# Each layout's step sizes are functions of the facts alone, so the planner can check that a
# document fits (receipt_rows, ...) before anything is drawn.

def receipt_step(font: int) -> int:
    return round(font * 1.55)


def receipt_capacity(size: tuple[int, int], font: int) -> int:
    """Item lines a receipt of this size holds: header (store, date, gap), items, dashes, total."""
    return int((size[1] - 2 * 24) / receipt_step(font)) - 5


def shelf_row_height(size: tuple[int, int], rows: int) -> float:
    return size[1] / rows


def table_geometry(size: tuple[int, int], rows: int, cols: int) -> tuple[float, float, float, float]:
    """(left margin, label column width, value column width, row height) of a table."""
    margin = 24
    label = (size[0] - 2 * margin) * 0.28
    return margin, label, (size[0] - 2 * margin - label) / cols, (size[1] - 2 * margin) / (rows + 1)


# ----------------------------------------------------------------------------------- drawing

def _draw_receipt(doc: Receipt, rng: random.Random, img: Image.Image, marks: list[Mark]) -> None:
    W, H = img.size
    draw = ImageDraw.Draw(img)
    ink = drawing.ink_colour(rng)
    step = receipt_step(doc.font)
    # a paper strip narrower than the image: the margins are the plain background of a photo of it
    side = rng.randint(8, 20)
    draw.rectangle((side, 8, W - side, H - 8), fill=drawing.paper_colour(rng), outline=drawing.shade(rng, (200, 200, 200), 10))
    mx = side + rng.randint(12, 20)
    y = 24 + step / 2 + rng.uniform(-3, 3)
    _write(draw, marks, (W / 2, y), doc.store, round(doc.font * 1.15), ink, "mm")
    y += step
    _write(draw, marks, (W / 2, y), doc.date, doc.font, ink, "mm")
    y += step * 1.5
    for name, price in doc.items:
        _write(draw, marks, (mx, y), name, doc.font, ink, "lm")
        _write(draw, marks, (W - mx, y), price, doc.font, ink, "rm")
        y += step
    _dashes(draw, mx, W - mx, y - step / 2, ink, 2)
    y += step / 2
    _write(draw, marks, (mx, y), "TOTAL", doc.font, ink, "lm")
    _write(draw, marks, (W - mx, y), doc.total, doc.font, ink, "rm")


def _draw_shelf(doc: Shelf, rng: random.Random, img: Image.Image, marks: list[Mark]) -> None:
    W, H = img.size
    draw = ImageDraw.Draw(img)
    row_h = shelf_row_height(img.size, len(doc.rows))
    wood = drawing.shade(rng, (150, 110, 70), 15)
    for r, row in enumerate(doc.rows):
        plank = (r + 1) * row_h - 14
        draw.rectangle((0, plank, W, plank + 14), fill=wood)  # the shelf edge the tags hang above
        cell = W / len(row)
        for c, (name, price) in enumerate(row):
            ink = drawing.ink_colour(rng)
            cx = (c + 0.5) * cell + rng.uniform(-6, 6)
            half_w = min(cell / 2 - 10, max(text_width(name, doc.font), text_width(price, 2 * doc.font)) / 2 + 18)
            top, bottom = plank - 20 - doc.font * 3.6, plank - 8
            tint = drawing.shade(rng, rng.choice([(255, 248, 200), (255, 255, 255), (255, 225, 225)]), 5)
            draw.rectangle((cx - half_w, top, cx + half_w, bottom), fill=tint, outline=ink, width=2)
            _write(draw, marks, (cx, top + 8 + doc.font * 0.5), name, doc.font, ink, "mm")
            _write(draw, marks, (cx, bottom - 8 - doc.font), price, 2 * doc.font, ink, "mm")


def _draw_table(doc: Table, rng: random.Random, img: Image.Image, marks: list[Mark]) -> None:
    W, H = img.size
    draw = ImageDraw.Draw(img)
    ink = drawing.ink_colour(rng)
    margin, label_w, col_w, row_h = table_geometry(img.size, len(doc.rows), len(doc.columns))
    x_end, y_end = margin + label_w + col_w * len(doc.columns), margin + row_h * (len(doc.rows) + 1)
    draw.rectangle((margin, margin, x_end, margin + row_h), fill=drawing.shade(rng, (225, 230, 240), 8))
    for r in range(len(doc.rows) + 2):  # horizontal rules
        draw.line((margin, margin + r * row_h, x_end, margin + r * row_h), fill=ink, width=2)
    for c in range(len(doc.columns) + 2):  # vertical rules
        x = margin if c == 0 else margin + label_w + (c - 1) * col_w
        draw.line((x, margin, x, y_end), fill=ink, width=2)
    for c, head in enumerate(doc.columns):
        _write(draw, marks, (margin + label_w + (c + 0.5) * col_w, margin + row_h / 2), head, doc.font, ink, "mm")
    for r, (label, values) in enumerate(doc.rows, start=1):
        y = margin + (r + 0.5) * row_h
        _write(draw, marks, (margin + 10, y), label, doc.font, ink, "lm")
        for c, v in enumerate(values):
            _write(draw, marks, (margin + label_w + (c + 0.5) * col_w, y), v, doc.font, ink, "mm")


def _draw_form(doc: Form, rng: random.Random, img: Image.Image, marks: list[Mark]) -> None:
    W, H = img.size
    draw = ImageDraw.Draw(img)
    ink = drawing.ink_colour(rng)
    step = (H - 48) / (len(doc.fields) + 2)
    mx = rng.randint(24, 36)
    _write(draw, marks, (W / 2, 24 + step / 2), doc.title, round(doc.font * 1.3), ink, "mm")
    box_x = mx + text_width("AMOUNT:", doc.font) + 24  # the widest label
    for k, (label, value) in enumerate(doc.fields):
        y = 24 + (k + 1.5) * step
        _write(draw, marks, (mx, y), label + ":", doc.font, ink, "lm")
        box = (box_x, y - doc.font, W - mx, y + doc.font)
        draw.rectangle(box, outline=drawing.shade(rng, (120, 120, 120), 20), width=2)
        _write(draw, marks, (box_x + 10, y), value, doc.font, ink, "lm")


def _draw_photo(doc: Photo, rng: random.Random, img: Image.Image, marks: list[Mark]) -> None:
    W, H = img.size
    # A smooth two-colour gradient: a 1 x 2 image stretched (fast, no per-pixel Python).
    ramp = Image.new("RGB", (1, 2))
    ramp.putpixel((0, 0), doc.top)
    ramp.putpixel((0, 1), doc.bottom)
    img.paste(ramp.resize((W, H), Image.Resampling.BILINEAR))
    draw = ImageDraw.Draw(img)
    slot = W / len(doc.shapes)
    for k, (shape, colour) in enumerate(doc.shapes):
        size = min(slot, H) * rng.uniform(0.35, 0.6)
        x0 = k * slot + rng.uniform(0.1 * slot, 0.9 * slot - size)
        y0 = rng.uniform(0.15 * H, 0.85 * H - size)
        fill = drawing.shade(rng, drawing.COLOURS[colour], 15)
        box = (x0, y0, x0 + size, y0 + size)
        if shape == "circle":
            draw.ellipse(box, fill=fill)
        elif shape == "square":
            draw.rectangle(box, fill=fill)
        else:
            draw.polygon([(x0 + size / 2, y0), (x0 + size, y0 + size), (x0, y0 + size)], fill=fill)


_DRAW = {Receipt: _draw_receipt, Shelf: _draw_shelf, Table: _draw_table, Form: _draw_form, Photo: _draw_photo}


def draw(doc: Doc, rng: random.Random) -> Drawn:
    """Pixels of `doc` (jitter from `rng`) and the characters printed on it."""
    background = drawing.shade(rng, (200, 195, 185), 20) if isinstance(doc, Receipt) else drawing.paper_colour(rng)
    img = Image.new("RGB", doc.size, background)
    marks: list[Mark] = []
    _DRAW[type(doc)](doc, rng, img, marks)
    return Drawn(img, tuple(marks))
