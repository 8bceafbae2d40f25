"""What a JPEG's bytes say without decoding it: its frame size, and whether it was cut short.

`image_decode` reads both for every image of a request before DALI decodes anything: the size to
refuse an image that announces too many pixels (other formats go through DALI's header pass), the
end marker so that a truncated JPEG fails the same way on the CPU and the GPU.
"""
from __future__ import annotations

import numpy as np

EOI_WINDOW = 4096  # a JPEG's end-of-image marker must be within this many bytes of its end


def truncated_jpeg(data: np.ndarray) -> bool:
    """A JPEG without its end-of-image marker near the end was cut short. nvJPEG on the GPU decodes
    such data without complaint (grey fill), so this host check keeps CPU and GPU behaviour equal.
    Entropy-coded data never holds FF D9 (FF is byte-stuffed), so the marker cannot be faked."""
    return data[:2].tobytes() == b"\xff\xd8" and b"\xff\xd9" not in data[-EOI_WINDOW:].tobytes()


# Start-of-frame markers C0-CF carry the frame's size; C4 (Huffman tables), C8 (reserved) and CC
# (arithmetic conditioning) share the range but are not frames.
_SOF = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}
_STANDALONE = frozenset(range(0xD0, 0xD8)) | {0x01}  # RSTn and TEM: markers without a length


def jpeg_size(data: np.ndarray) -> tuple[int, int] | None:
    """(height, width) from a JPEG's start-of-frame header, walking its marker segments (a few dozen
    bytes read, however large the file); None when it is no JPEG or the walk does not reach a frame
    header with both sides set (then DALI's header pass decides). The sides are the frame's own, as
    nvJPEG reads them; EXIF orientation may swap them, which changes neither the pixel count nor
    the aspect ratio that the checks read."""
    buf, i = memoryview(data), 2
    if buf[:2] != b"\xff\xd8":
        return None
    while i + 4 <= len(buf):
        if buf[i] != 0xFF:
            return None  # not at a marker: let DALI judge the file
        marker = buf[i + 1]
        if marker == 0xFF:  # fill byte before a marker
            i += 1
        elif marker in _STANDALONE:
            i += 2
        elif marker in _SOF:
            if i + 9 > len(buf):
                return None
            height, width = int.from_bytes(buf[i + 5:i + 7], "big"), int.from_bytes(buf[i + 7:i + 9], "big")
            return (height, width) if height and width else None  # height 0: set later by a DNL marker
        elif marker in (0xD9, 0xDA):
            return None  # end of image, or scan data, before any frame header
        else:
            i += 2 + int.from_bytes(buf[i + 2:i + 4], "big")
    return None
