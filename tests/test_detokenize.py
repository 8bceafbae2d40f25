"""Streaming detokenisation: deltas concatenate to the tokenizer's own decode, UTF-8 intact."""
from __future__ import annotations

import random

import pytest
from transformers import AutoTokenizer

from zipmoe.detokenize import TextStream, TokenBytes, utf8_safe_end, window_text

TEXTS = [
    "Hello world, the total is $12.50 — thanks!",
    "你好世界，这张收据的总价是十二元五角。",
    "emoji 🙂🍕👩‍👩‍👧 and mixed 中文 text",
    "  leading spaces and\nnew lines\n\n",
]


@pytest.fixture(scope="module")
def tok(tiny_checkpoint):
    return AutoTokenizer.from_pretrained(tiny_checkpoint)


@pytest.fixture(scope="module")
def table(tiny_checkpoint):
    return TokenBytes.from_tokenizer_json(tiny_checkpoint)


def stream(table, ids, stop=()):
    """What the decoder + postprocess produce, one delta per token; the last response is final."""
    ts = TextStream(table, tuple(s.encode() for s in stop))
    deltas = []
    for n, t in enumerate(ids, 1):
        stopped = ts.push(t)
        final = stopped or n == len(ids)
        first, begin, end = ts.release(final)
        deltas.append(window_text(table, ids[first:n], begin, end))
        if stopped:
            break
    return deltas


@pytest.mark.parametrize("text", TEXTS)
def test_stream_of_encoded_text_is_exact(tok, table, text):
    ids = tok.encode(text, add_special_tokens=False)
    deltas = stream(table, ids)
    assert "".join(deltas) == text == tok.decode(ids, skip_special_tokens=True)
    assert all("\ufffd" not in d for d in deltas)  # never half a character


def test_random_ids_match_tokenizer_decode(tok, table):
    """Arbitrary token soup (stray bytes, specials, split characters) still decodes exactly."""
    rng = random.Random(0)
    for _ in range(200):
        ids = [rng.randrange(len(tok)) for _ in range(rng.randrange(1, 40))]
        assert "".join(stream(table, ids)) == tok.decode(ids, skip_special_tokens=True)


def test_chinese_split_across_tokens_is_held_back(table):
    ids = [ord_byte_token(table, b) for b in "你好".encode()]  # one byte per token
    deltas = stream(table, ids)
    assert deltas == ["", "", "你", "", "", "好"]


def ord_byte_token(table, byte):
    return table.table.index(bytes([byte]))


def test_stop_string_is_cut_and_never_streamed(tok, table):
    text = "The total is twelve dollars. END of receipt"
    ids = tok.encode(text, add_special_tokens=False)
    deltas = stream(table, ids, stop=["END"])
    assert "".join(deltas) == "The total is twelve dollars. "
    assert not any("E" in d for d in deltas)


def test_utf8_safe_end():
    s = "a你".encode()  # 61 e4 bd a0
    assert [utf8_safe_end(s, n) for n in range(5)] == [0, 1, 1, 1, 4]
    assert utf8_safe_end(b"\xbf\xbf", 2) == 2  # stray continuation bytes are complete (they become U+FFFD)
    assert utf8_safe_end("🙂".encode(), 3) == 0


def test_non_byte_level_tokenizer_is_refused(tmp_path):
    (tmp_path / "tokenizer.json").write_text('{"decoder": {"type": "Metaspace"}, "model": {"vocab": {}}}')
    with pytest.raises(ValueError, match="byte-level"):
        TokenBytes.from_tokenizer_json(tmp_path)
