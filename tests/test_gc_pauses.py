"""The decoder process's garbage-collector accounting (serving/gc_pauses.py)."""
from __future__ import annotations

import gc

from zipmoe.serving.gc_pauses import GcPauses


def test_every_collection_is_counted_until_closed():
    pauses = GcPauses()
    try:
        gc.collect(0)
        gc.collect(2)
        stats = pauses.stats()
        assert stats["gc_collections"] >= 2 and stats["gc_full_collections"] >= 1 and stats["gc_pause_us"] > 0
    finally:
        pauses.close()
    gc.collect(2)
    assert pauses.stats() == stats

