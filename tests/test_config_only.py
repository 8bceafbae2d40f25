"""The config-only Qwen3-VL-30B-A3B directory: reproducible, read correctly by transformers and by zipmoe."""

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer
from transformers import PreTrainedTokenizerFast, Qwen3VLMoeConfig

from zipmoe.build.config_only import FIRST_SPECIAL_ID, SPECIAL_TOKENS, build_config_only, filler
from zipmoe.build.tiny_checkpoint import build_tokenizer
from zipmoe.checkpoint import TextConfig
from zipmoe.detokenize import TokenBytes
from zipmoe.prompt import ChatPrompt

COMMITTED = Path(__file__).resolve().parents[1] / "checkpoints" / "qwen3-vl-30b-a3b"
VOCAB_SIZE = 151936  # the model's embedding rows; the tokenizer has 151657 tokens
TEXT = "Hello world, 你好世界 🙂 $12.50 <|filler_2000|> <|im_end|>"


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    return build_config_only(tmp_path_factory.mktemp("qwen3-vl-30b-a3b"))


@pytest.fixture(scope="module")
def tok(built) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast.from_pretrained(built)


def _files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


def test_committed_directory_is_a_fresh_build(built):
    assert _files(COMMITTED) == _files(built), "rebuild: python -m zipmoe.build.config_only --out checkpoints/qwen3-vl-30b-a3b"
    assert sorted(_files(built)) == ["README.md", "config.json", "generation_config.json", "preprocessor_config.json",
                                     "tokenizer.json", "tokenizer_config.json"]  # no weights
    assert (built / "tokenizer.json").stat().st_size < 5 * 2**20


def test_transformers_reads_the_config(built):
    cfg = Qwen3VLMoeConfig.from_pretrained(built)
    text, vision = cfg.text_config, cfg.vision_config
    assert (text.hidden_size, text.num_hidden_layers, text.num_attention_heads, text.num_key_value_heads) == (2048, 48, 32, 4)
    assert (text.num_experts, text.num_experts_per_tok, text.moe_intermediate_size, text.vocab_size) == (128, 8, 768, VOCAB_SIZE)
    assert text.rope_parameters["rope_theta"] == 5_000_000
    assert text.rope_parameters["mrope_section"] == [24, 20, 20] and text.rope_parameters["mrope_interleaved"]
    assert (vision.depth, vision.hidden_size, vision.out_hidden_size, vision.deepstack_visual_indexes) == (27, 1152, 2048, [8, 16, 24])
    assert (cfg.image_token_id, cfg.video_token_id, cfg.vision_start_token_id, cfg.vision_end_token_id) == (151655, 151656, 151652, 151653)


def test_zipmoe_reads_the_config(built):
    cfg = TextConfig.from_dir(built)
    assert cfg.rope_theta == 5e6
    assert cfg.mrope_section == (24, 20, 20)
    assert cfg.moe_layers == (True,) * 48
    assert (cfg.num_experts, cfg.top_k, cfg.head_dim, cfg.num_kv_heads, cfg.vocab_size) == (128, 8, 128, 4, VOCAB_SIZE)
    assert cfg.image_token_id == 151655
    assert cfg.eos_token_ids == (151645, 151643)  # from generation_config.json
    assert not cfg.tie_word_embeddings


def test_special_tokens_at_qwen_ids(built, tok):
    ids = tok.convert_tokens_to_ids(list(SPECIAL_TOKENS))
    assert ids == list(range(151643, 151657))
    assert len(tok) == 151657 == FIRST_SPECIAL_ID + len(SPECIAL_TOKENS)
    assert (tok.eos_token_id, tok.pad_token_id) == (151645, 151643)
    assert tok.convert_ids_to_tokens([1792, 151642]) == [filler(1792), filler(151642)]

    gen = json.loads((built / "generation_config.json").read_text())
    assert (gen["bos_token_id"], gen["eos_token_id"], gen["pad_token_id"]) == (151643, [151645, 151643], 151643)


def test_regular_vocabulary_is_the_tiny_checkpoints(built, tok, tmp_path):
    """Text encodes exactly as with tiny_checkpoint's tokenizer (fillers unreachable), and round-trips."""
    tiny = build_tokenizer(tmp_path)
    plain = TEXT.replace("<|im_end|>", "")
    ids = tok(plain)["input_ids"]
    assert ids == tiny(plain)["input_ids"] and max(ids) < 1792
    assert tok.decode(ids) == plain
    assert tok(TEXT)["input_ids"][-1] == 151645


def test_prompt_with_two_images(built):
    ids = ChatPrompt(built).encode("What is on the receipt?", 2)
    assert ids.count(151655) == 2
    first = ids.index(151655)
    assert ids[first - 1: first + 5] == [151652, 151655, 151653, 151652, 151655, 151653]
    assert ids[0] == 151644 and 151645 in ids


def test_token_bytes_cover_the_model_vocabulary(built):
    tb = TokenBytes.from_tokenizer_json(built)
    table = [tb[i] for i in range(VOCAB_SIZE)]  # the dummy model may emit any id below vocab_size
    assert table[1792] == b"<|filler_1792|>"
    assert table[151643:] == [b""] * (VOCAB_SIZE - 151643)  # specials and unused rows: no text
    raw = Tokenizer.from_file(str(built / "tokenizer.json"))
    ids = raw.encode(TEXT).ids
    assert tb.join(ids).decode() == raw.decode(ids, skip_special_tokens=True)


def test_image_config(built):
    from zipmoe.image_pipeline import ImageConfig  # imports DALI

    cfg = ImageConfig.from_checkpoint(built)
    assert (cfg.factor, cfg.min_pixels, cfg.max_pixels) == (32, 65536, 16777216)
    assert cfg.mean == cfg.std == (0.5, 0.5, 0.5)
