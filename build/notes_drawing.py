"""Drawing for `build/notes_data.py`: one note (what an image shows, `notes_data._Note`) -> a
128 x 128 RGB image, with the same random draws in the same order for the same seed.

Text is drawn with Pillow's bundled TrueType font (`ImageFont.load_default(size=...)`,
Pillow >= 10.1 with FreeType), large enough to stay legible at 16-pixel patches:
price digits ~40-45 px tall, receipt lines in a 21-23 px font, table digits ~30 px.
"""
from __future__ import annotations

import functools
import random
from typing import TYPE_CHECKING

from PIL import Image, ImageDraw, ImageFont

if TYPE_CHECKING:
    from zipmoe.build.notes_data import _Note

IMAGE_SIZE: tuple[int, int] = (128, 128)  # (width, height); keep both multiples of 32
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (215, 45, 45),
    "green": (45, 160, 70),
    "blue": (45, 90, 215),
    "yellow": (240, 205, 40),
}



@functools.lru_cache(maxsize=None)
def load_font(size: int) -> ImageFont.FreeTypeFont:
    font = ImageFont.load_default(size=size)
    if not isinstance(font, ImageFont.FreeTypeFont):  # Pillow < 10.1 or built without FreeType
        raise RuntimeError("notes_drawing needs Pillow >= 10.1 with FreeType (ImageFont.load_default(size=...))")
    return font


def shade(rng: random.Random, rgb, spread: int) -> tuple[int, int, int]:
    return tuple(min(255, max(0, c + rng.randint(-spread, spread))) for c in rgb)


def paper_colour(rng: random.Random) -> tuple[int, int, int]:
    v = rng.randint(244, 255)
    return shade(rng, (v, v, v), 3)


def ink_colour(rng: random.Random) -> tuple[int, int, int]:
    v = rng.randint(0, 45)
    return (v, v, min(255, v + rng.randint(0, 20)))


def draw_text(draw: ImageDraw.ImageDraw, xy, text: str, font, fill, anchor: str) -> None:
    """Draw `text` with its ink box (not the font's line box) placed by `anchor` at xy.

    anchor: two letters, horizontal l|m|r then vertical t|m|b."""
    x0, y0, x1, y1 = font.getbbox(text)
    x, y = xy
    x -= {"l": x0, "m": (x0 + x1) / 2, "r": x1}[anchor[0]]
    y -= {"t": y0, "m": (y0 + y1) / 2, "b": y1}[anchor[1]]
    draw.text((round(x), round(y)), text, font=font, fill=fill)


def _draw_price_tag(note: _Note, rng: random.Random, img: Image.Image) -> None:
    W, H = img.size
    s = min(W, H) / 128
    draw = ImageDraw.Draw(img)
    ink = ink_colour(rng)
    cx, cy = W / 2 + rng.uniform(-2, 2) * s, H / 2 + rng.uniform(-4, 4) * s
    half_w, half_h = (59 + rng.uniform(-1.5, 1.5)) * s, (36 + rng.uniform(-3, 3)) * s
    notch = 11 * s
    x0, x1, y0, y1 = cx - half_w, cx + half_w, cy - half_h, cy + half_h
    tag = [(x0, cy), (x0 + notch, y0), (x1, y0), (x1, y1), (x0 + notch, y1)]
    tint = shade(rng, rng.choice([(255, 248, 215), (235, 245, 255), (255, 235, 235), (250, 250, 250)]), 5)
    line = max(2, round(3 * s))
    draw.polygon(tag, fill=tint, outline=ink, width=line)
    r = 3 * s
    hx = x0 + notch * 0.9
    draw.ellipse((hx - r, cy - r, hx + r, cy + r), outline=ink, width=max(1, round(2 * s)))
    # "$" small and raised, then the digits as large as fit between the hole and the right edge.
    text, gap = str(note.price), 2 * s
    dollar = load_font(round(rng.randint(28, 32) * s))
    sw = ink_width(dollar, "$")
    avail = (x1 - line - 3 * s) - (hx + r + 3 * s)
    size = round(rng.randint(60, 64) * s)
    while size > 8 and sw + gap + ink_width(load_font(size), text) > avail:
        size -= 1
    digits = load_font(size)
    dw = ink_width(digits, text)
    left = (hx + r + 3 * s + x1 - line - 3 * s) / 2 - (sw + gap + dw) / 2
    draw_text(draw, (left + sw + gap, cy), text, digits, ink, "lm")
    bbox = digits.getbbox(text)
    draw_text(draw, (left, cy - (bbox[3] - bbox[1]) / 2), "$", dollar, ink, "lt")


def ink_width(font, text: str) -> float:
    x0, _, x1, _ = font.getbbox(text)
    return x1 - x0


def _draw_receipt(note: _Note, rng: random.Random, img: Image.Image) -> None:
    W, H = img.size
    s = min(W, H) / 128
    draw = ImageDraw.Draw(img)
    ink = ink_colour(rng)
    font = load_font(round(rng.randint(21, 23) * s))
    rows = len(note.items) + 1
    mx = (8 + rng.uniform(-2, 3)) * s
    step = min(28 * s, (H - 18 * s) / (rows + 0.4))
    top = (H - step * (rows + 0.4)) / 2 + rng.uniform(-2, 2) * s
    draw.rectangle((2 * s, 2 * s, W - 3 * s, H - 3 * s), outline=shade(rng, (200, 200, 200), 10))
    y = top
    for label, value in note.items:
        draw_text(draw, (mx, y + step / 2), label, font, ink, "lm")
        draw_text(draw, (W - mx, y + step / 2), f"{value:02d}", font, ink, "rm")
        y += step
    sep = y + step * 0.2
    for x in range(round(mx), round(W - mx), max(2, round(6 * s))):  # dashed separator
        draw.line((x, sep, x + 3 * s, sep), fill=ink, width=max(1, round(2 * s)))
    y += step * 0.4
    draw_text(draw, (mx, y + step / 2), "TOTAL", font, ink, "lm")
    draw_text(draw, (W - mx, y + step / 2), f"{note.total:02d}", font, ink, "rm")


def _draw_table(note: _Note, rng: random.Random, img: Image.Image) -> None:
    W, H = img.size
    s = min(W, H) / 128
    draw = ImageDraw.Draw(img)
    ink = ink_colour(rng)
    m = (10 + rng.uniform(-3, 3)) * s
    x0, y0, x1, y1 = m, m + rng.uniform(-2, 2) * s, W - m, H - m + rng.uniform(-2, 2) * s
    width = max(2, round(3 * s))
    draw.rectangle((x0, y0, x1, y1), outline=ink, width=width)
    xm, ym = (x0 + x1) / 2, (y0 + y1) / 2
    draw.line((xm, y0, xm, y1), fill=ink, width=width)
    draw.line((x0, ym, x1, ym), fill=ink, width=width)
    font = load_font(round(rng.randint(40, 46) * s))
    for k, v in enumerate(note.cells):
        cx = (x0 + xm) / 2 if k % 2 == 0 else (xm + x1) / 2
        cy = (y0 + ym) / 2 if k < 2 else (ym + y1) / 2
        draw_text(draw, (cx, cy), str(v), font, ink, "mm")


def _draw_shape(note: _Note, rng: random.Random, img: Image.Image) -> None:
    W, H = img.size
    draw = ImageDraw.Draw(img)
    size = min(W, H) * rng.uniform(0.5, 0.75)
    x0 = rng.uniform(0.08 * W, W - 0.08 * W - size)
    y0 = rng.uniform(0.08 * H, H - 0.08 * H - size)
    box = (x0, y0, x0 + size, y0 + size)
    fill = shade(rng, COLOURS[note.colour], 15)
    if note.shape == "circle":
        draw.ellipse(box, fill=fill)
    elif note.shape == "square":
        draw.rectangle(box, fill=fill)
    else:
        draw.polygon([(x0 + size / 2, y0), (x0 + size, y0 + size), (x0, y0 + size)], fill=fill)


def render(note: _Note, rng: random.Random) -> Image.Image:
    if note.type == "solid":
        return Image.new("RGB", IMAGE_SIZE, shade(rng, COLOURS[note.colour], 15))
    img = Image.new("RGB", IMAGE_SIZE, paper_colour(rng))
    {"price_tag": _draw_price_tag, "receipt": _draw_receipt, "table": _draw_table,
     "shape": _draw_shape}[note.type](note, rng, img)
    return img
