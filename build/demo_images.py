"""Two deterministic note images for the demo: a detail-dense receipt and a plain coloured shape."""
from __future__ import annotations

import io

from PIL import Image, ImageDraw

RECEIPT_LINES = ["CAFE NOTE  #0042", "espresso      2.80", "flat white    3.90", "croissant     2.40",
                 "cold brew     4.50", "--------------------", "TOTAL        13.60", "thank you!"]


def receipt_png() -> bytes:
    img = Image.new("RGB", (384, 512), "white")
    draw = ImageDraw.Draw(img)
    for i, line in enumerate(RECEIPT_LINES):
        draw.text((24, 24 + 56 * i), line, fill="black")
        draw.line((24, 60 + 56 * i, 360, 60 + 56 * i), fill=(200, 200, 200))
    return _png(img)


def plain_png() -> bytes:
    img = Image.new("RGB", (512, 384), (90, 140, 220))
    ImageDraw.Draw(img).ellipse((176, 112, 336, 272), fill=(230, 60, 60))
    return _png(img)


def _png(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()
