"""An image as a client sent it -> the image file's bytes.

Images reach the server three ways: raw file bytes in a gRPC BYTES tensor, base64 text in the JSON
of Triton's HTTP `generate` endpoints (which turns `"images": ["..."]` into a BYTES tensor of the
strings' UTF-8), and `data:image/...;base64,...` URLs (the OpenAI frontend, or a client that sends
one as it is). `image_decode` (where the mm_qa ensemble's images enter) and `mm_qa_bls` call
`decode_images`, so the DALI pipeline, the vision encoder and the embedding cache only ever see
file bytes; the OpenAI frontend calls it on the data URLs of a chat request and sends the file
bytes on over gRPC.
"""
from __future__ import annotations

import base64
import binascii
import re

from .serving.errors import BadInput

# The characters of base64 (standard and URL-safe) and the line breaks of wrapped base64 (`base64`
# wraps at 76 columns). An image file holds other bytes within its first bytes (JPEG FF D8, PNG 89,
# BMP/TIFF/WebP/JPEG 2000 headers hold zero bytes), so testing a short head tells them apart cheaply.
_BASE64_HEAD = re.compile(rb"[A-Za-z0-9+/=_\-\r\n]*")
HEAD = 64
_DATA_URL = re.compile(rb"data:([\w.+-]+/[\w.+-]+)?((?:;[^;,]*)*?)(;base64)?,", re.IGNORECASE)


def _base64(text: bytes, what: str) -> bytes:
    text = re.sub(rb"[\r\n]", b"", text).replace(b"-", b"+").replace(b"_", b"/")
    text += b"=" * (-len(text) % 4)  # padding is often left out (URL-safe base64)
    try:
        return base64.b64decode(text, validate=True)
    except binascii.Error as e:
        raise BadInput(f"{what}: not valid base64 ({e})") from None


def image_bytes(value: bytes, what: str = "image") -> bytes:
    """A data URL or base64 text decoded; raw file bytes (or an empty value) as they are.
    `what` names the image in errors ("image 2")."""
    if value[:5].lower() == b"data:":
        m = _DATA_URL.match(value)
        if m is None or m.group(3) is None:
            raise BadInput(f"{what}: a data URL must carry base64 data: data:image/png;base64,...")
        return _base64(value[m.end():], what)
    if value and _BASE64_HEAD.fullmatch(value[:HEAD]):
        return _base64(value, what)
    return value


def decode_images(values: list[bytes]) -> list[bytes]:
    """A request's images, each as file bytes; errors name the image by its index in the request."""
    return [image_bytes(v, f"image {i}") for i, v in enumerate(values)]
