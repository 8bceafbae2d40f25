"""image_input: file bytes, base64 text and data URLs all become the image file's bytes."""
from __future__ import annotations

import base64
import io

import pytest
from PIL import Image

from zipmoe.image_input import decode_images, image_bytes
from zipmoe.serving.errors import BadInput


def encoded(fmt: str) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (40, 30), (200, 30, 90)).save(buf, format=fmt)
    return buf.getvalue()


FORMATS = ["JPEG", "PNG", "BMP", "TIFF", "WEBP"]


@pytest.mark.parametrize("fmt", FORMATS)
def test_file_bytes_pass_as_they_are(fmt):
    data = encoded(fmt)
    assert image_bytes(data) is data


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("encode", [
    base64.b64encode,
    base64.encodebytes,  # wrapped at 76 columns, as `base64` prints it
    lambda b: base64.urlsafe_b64encode(b).rstrip(b"="),  # URL-safe, padding left out
    lambda b: b"data:image/png;base64," + base64.b64encode(b),
    lambda b: b"DATA:image/webp;name=x.webp;base64," + base64.b64encode(b),
])
def test_base64_and_data_urls_are_decoded(fmt, encode):
    data = encoded(fmt)
    assert image_bytes(encode(data)) == data


@pytest.mark.parametrize("value, message", [
    (b"aGVsbG8gd", "image 1: not valid base64"),  # 9 characters: one too many for base64
    (b"data:image/png,rawtext", "image 1: a data URL must carry base64 data"),
    (b"data:image/png;base64,#!", "image 1: not valid base64"),
])
def test_broken_base64_is_refused_naming_the_image(value, message):
    with pytest.raises(BadInput, match=message):
        decode_images([encoded("PNG"), value])


def test_empty_and_foreign_bytes_are_left_to_the_decoder():
    # image_decode names these ("image 0: empty", "cannot decode"): they are not base64 either way.
    assert decode_images([b"", b"not an image at all"]) == [b"", b"not an image at all"]
