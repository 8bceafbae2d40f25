"""jpeg_header: a JPEG's frame size read from its markers, against Pillow's decoder, over the ways
encoders lay a file out (progressive, EXIF, an ICC profile split over several segments, restart
markers, grey and CMYK); anything else is left to DALI's header pass (None)."""
from __future__ import annotations

import io
import struct

import numpy as np
import pytest
from PIL import Image

from zipmoe.jpeg_header import jpeg_size, truncated_jpeg

SIZES = [(1, 1), (7, 9), (333, 517), (768, 1024), (1200, 700)]
LAYOUTS = {
    "baseline": {}, "progressive": {"progressive": True}, "optimized": {"quality": 20, "optimize": True},
    "exif": {"exif": Image.Exif().tobytes()}, "icc over two segments": {"icc_profile": b"\x00" * 70_000},
    "restart markers": {"restart_marker_blocks": 1},
}


def jpeg(height: int, width: int, mode: str = "RGB", **options) -> bytes:
    pixels = np.random.default_rng(height * 7 + width).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).convert(mode).save(buf, "JPEG", **options)
    return buf.getvalue()


def array(data: bytes) -> np.ndarray:
    return np.frombuffer(data, np.uint8)  # as image_decode holds a request's image


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("mode", ["RGB", "L", "CMYK"])
def test_frame_size_is_what_pillow_decodes(layout, mode):
    for height, width in SIZES:
        data = jpeg(height, width, mode, **LAYOUTS[layout])
        with Image.open(io.BytesIO(data)) as decoded:
            assert decoded.size == (width, height)
        assert jpeg_size(array(data)) == (height, width)


def test_an_announced_size_is_read_from_the_header_alone():
    """The guard's case: a small file whose frame header announces 20000 x 30000."""
    data = bytearray(jpeg(8, 8))
    sof = data.index(b"\xff\xc0")
    data[sof + 5:sof + 9] = struct.pack(">HH", 20000, 30000)
    assert jpeg_size(array(bytes(data))) == (20000, 30000)


@pytest.mark.parametrize("data", [
    b"", b"\xff\xd8", b"not a jpeg at all", b"\x89PNG\r\n\x1a\n" + b"\x00" * 40,
    b"\xff\xd8\xff\xda\x00\x08" + b"\x00" * 20,  # scan data before any frame header
    b"\xff\xd8\xff\xe0\x00\x10JFIF\x00" + b"\x01" * 7 + b"\x12\x34",  # the walk leaves the markers
    b"\xff\xd8\xff\xc0\x00\x11\x08\x00\x00\x00\x10\x03",  # height 0: set later by a DNL marker
    b"\xff\xd8\xff\xc0\x00\x11\x08\x00",  # the frame header cut short
], ids=["empty", "soi only", "text", "png", "scan first", "off the markers", "height zero", "cut frame header"])
def test_what_is_not_read_is_left_to_dali(data):
    assert jpeg_size(array(data)) is None


def test_a_jpeg_without_its_end_marker_is_truncated():
    data = jpeg(64, 64)
    assert not truncated_jpeg(array(data))
    assert truncated_jpeg(array(data[: len(data) // 2]))
    assert not truncated_jpeg(array(b"GIF89a" + b"\x00" * 100))  # only JPEGs are judged by this
