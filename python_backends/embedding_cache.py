"""Visual-feature cache for mm_qa_bls: an LRU keyed by image content, bounded by bytes.

A key is the sha256 hex digest of the encoded image, so the same picture sent again (a follow-up
question, a shared logo, a multi-turn chat resending its images) skips decoding and the vision
tower. Values are `visionzip.ImageFeatures` *before* compression: VisionZip runs per request on
top, because a request's images share one token budget and its keep ratio may differ.
"""
from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict

from .visionzip import ImageFeatures


def content_key(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def feature_bytes(value: ImageFeatures) -> int:
    """Bytes held by a value's tensors (the grid tuple is negligible)."""
    return sum(t.numel() * t.element_size() for t in (value.embeds, value.deepstack, value.importance, value.keys))


class EmbeddingCache:
    """Thread-safe LRU over `ImageFeatures`, at most `budget_bytes` of tensors in all.

    Counters (read them freely; they only grow, except `bytes`): `hits`, `misses`, `evictions`,
    `bytes` (tensor bytes held now). A budget of 0 caches nothing.
    """

    def __init__(self, budget_bytes: int):
        if budget_bytes < 0:
            raise ValueError(f"budget_bytes must be >= 0, got {budget_bytes}")
        self.budget_bytes = budget_bytes
        self._entries: OrderedDict[str, tuple[ImageFeatures, int]] = OrderedDict()  # oldest use first
        self._lock = threading.Lock()
        self.hits = self.misses = self.evictions = self.bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: str) -> ImageFeatures | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                self.misses += 1
                return None
            self._entries.move_to_end(key)
            self.hits += 1
            return entry[0]

    def put(self, key: str, value: ImageFeatures) -> None:
        size = feature_bytes(value)
        if size > self.budget_bytes:
            return  # caching it would evict everything else and still not fit
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self.bytes -= old[1]
            while self.bytes + size > self.budget_bytes:
                _, (_, freed) = self._entries.popitem(last=False)
                self.bytes -= freed
                self.evictions += 1
            self._entries[key] = (value, size)
            self.bytes += size
