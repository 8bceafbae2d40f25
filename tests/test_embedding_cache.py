"""The BLS visual-feature cache: LRU order, byte budget, eviction, counters, thread safety."""
from concurrent.futures import ThreadPoolExecutor

import torch

from zipmoe.embedding_cache import EmbeddingCache, content_key, feature_bytes
from zipmoe.visionzip import ImageFeatures


def features(tokens: int, width: int = 8, layers: int = 2, dk: int = 4) -> ImageFeatures:
    """float32 features of `tokens` tokens: (width + layers * width + 1 + dk) * 4 bytes per token."""
    return ImageFeatures(torch.zeros(tokens, width), torch.zeros(layers, tokens, width), torch.zeros(tokens),
                         torch.zeros(tokens, dk), (1, tokens))


UNIT = feature_bytes(features(1))  # bytes of one token


def test_size_is_the_bytes_of_all_tensors():
    assert UNIT == (8 + 2 * 8 + 1 + 4) * 4
    assert feature_bytes(features(10)) == 10 * UNIT
    assert feature_bytes(ImageFeatures(torch.zeros(3, 8, dtype=torch.bfloat16), torch.zeros(2, 3, 8, dtype=torch.bfloat16),
                                       torch.zeros(3), torch.zeros(3, 4), (1, 3))) == 3 * 8 * 2 * 3 + 3 * 4 * 5


def test_content_key_is_sha256_hex():
    assert content_key(b"abc") == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"


def test_get_and_put_count_hits_and_misses():
    cache = EmbeddingCache(100 * UNIT)
    assert cache.get("a") is None
    value = features(10)
    cache.put("a", value)
    assert cache.get("a") is value
    assert (cache.hits, cache.misses, cache.evictions, cache.bytes, len(cache)) == (1, 1, 0, 10 * UNIT, 1)


def test_least_recently_used_is_evicted_first():
    cache = EmbeddingCache(30 * UNIT)
    for key in "abc":
        cache.put(key, features(10))
    cache.get("a")  # b is now the least recently used
    cache.put("d", features(10))
    assert cache.get("b") is None
    assert all(cache.get(k) is not None for k in "acd")
    assert cache.evictions == 1 and cache.bytes == 30 * UNIT


def test_eviction_frees_as_many_as_needed():
    cache = EmbeddingCache(30 * UNIT)
    for key in "abc":
        cache.put(key, features(10))
    cache.put("big", features(25))
    assert cache.evictions == 3 and len(cache) == 1 and cache.bytes == 25 * UNIT
    assert cache.get("big") is not None


def test_put_of_a_cached_key_replaces_it():
    cache = EmbeddingCache(30 * UNIT)
    cache.put("a", features(10))
    cache.put("b", features(10))
    newer = features(20)
    cache.put("a", newer)  # 20 + 10 fits: nothing evicted, the old value's bytes are returned
    assert cache.evictions == 0 and cache.bytes == 30 * UNIT and cache.get("a") is newer
    cache.put("c", features(5))  # b is the least recently used now
    assert cache.get("b") is None and cache.evictions == 1


def test_value_larger_than_the_budget_is_not_cached():
    cache = EmbeddingCache(30 * UNIT)
    cache.put("a", features(10))
    cache.put("huge", features(31))
    assert cache.get("huge") is None
    assert cache.get("a") is not None and cache.evictions == 0 and cache.bytes == 10 * UNIT
    cache.put("exact", features(30))  # exactly the budget fits
    assert cache.get("exact") is not None and cache.bytes == 30 * UNIT


def test_zero_budget_caches_nothing():
    cache = EmbeddingCache(0)
    cache.put("a", features(1))
    assert cache.get("a") is None and cache.bytes == 0 and len(cache) == 0


def test_concurrent_use_keeps_counters_and_budget_consistent():
    cache = EmbeddingCache(50 * UNIT)
    keys = [f"k{i}" for i in range(40)]

    def work(worker: int):
        for step in range(300):
            key = keys[(worker * 7 + step) % len(keys)]
            if cache.get(key) is None:
                cache.put(key, features(1 + step % 9))

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(work, range(8)))
    assert cache.hits + cache.misses == 8 * 300
    assert cache.bytes <= cache.budget_bytes
    assert cache.bytes == sum(feature_bytes(v) for v, _ in cache._entries.values())
    assert cache.hits > 0 and cache.evictions > 0
