"""The tiny Qwen3-VL-MoE checkpoint: deterministic, loadable by transformers, tokenizer as specified."""

import json

import pytest
import torch
from safetensors import safe_open
from tokenizers import Tokenizer, pre_tokenizers
from transformers import AutoTokenizer, Qwen3VLMoeForConditionalGeneration

from zipmoe.build.tiny_checkpoint import SPECIAL_TOKENS, build_tiny_checkpoint

TEXT = "Hello world, 你好世界 🙂 $12.50"


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), seed=0)


@pytest.fixture(scope="session")
def tok(tiny_dir):
    return AutoTokenizer.from_pretrained(tiny_dir)


def _files(d):
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


def test_build_is_deterministic_and_stamped(tiny_dir, tmp_path, capsys):
    other = build_tiny_checkpoint(tmp_path / "again", seed=0)
    assert _files(other) == _files(tiny_dir)

    build_tiny_checkpoint(other, seed=0)
    assert "up to date" in capsys.readouterr().out

    weights = (other / "model.safetensors").read_bytes()
    build_tiny_checkpoint(other, seed=1)
    assert "up to date" not in capsys.readouterr().out
    assert (other / "model.safetensors").read_bytes() != weights
    assert json.loads((other / "zipmoe_build.json").read_text())["seed"] == 1


def test_files_and_size(tiny_dir):
    names = set(_files(tiny_dir))
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json", "preprocessor_config.json", "zipmoe_build.json"} <= names
    assert sum(len(b) for b in _files(tiny_dir).values()) < 10 * 2**20


def test_special_token_ids_match_config(tiny_dir, tok):
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    # Right after the learned vocabulary, in the listed order.
    assert list(ids.values()) == list(range(len(tok) - len(SPECIAL_TOKENS), len(tok)))

    cfg = json.loads((tiny_dir / "config.json").read_text())
    assert cfg["model_type"] == "qwen3_vl_moe"
    assert cfg["image_token_id"] == ids["<|image_pad|>"]
    assert cfg["video_token_id"] == ids["<|video_pad|>"]
    assert cfg["vision_start_token_id"] == ids["<|vision_start|>"]
    assert cfg["vision_end_token_id"] == ids["<|vision_end|>"]
    text = cfg["text_config"]
    assert text["eos_token_id"] == ids["<|im_end|>"] == tok.eos_token_id
    assert text["vocab_size"] % 64 == 0 and text["vocab_size"] >= len(tok)

    gen = json.loads((tiny_dir / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [ids["<|im_end|>"], ids["<|endoftext|>"]]
    assert gen["pad_token_id"] == ids["<|endoftext|>"] == tok.pad_token_id


def test_tokenizer_round_trip(tiny_dir, tok):
    raw = Tokenizer.from_file(str(tiny_dir / "tokenizer.json"))
    assert set(pre_tokenizers.ByteLevel.alphabet()) <= set(raw.get_vocab())  # every byte is a token

    ids = tok(TEXT)["input_ids"]
    assert ids == raw.encode(TEXT).ids
    assert tok.decode(ids, skip_special_tokens=True) == TEXT

    with_specials = tok.convert_tokens_to_ids(["<|im_start|>"]) + ids + [tok.eos_token_id]
    assert tok.decode(with_specials, skip_special_tokens=True) == TEXT


def test_chat_template(tok):
    messages = [
        {"role": "system", "content": "You are helpful."},
        {"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "Compare them."}]},
    ]
    assert tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == (
        "<|im_start|>system\nYou are helpful.<|im_end|>\n"
        "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>"
        "<|vision_start|><|image_pad|><|vision_end|>Compare them.<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_safetensors_layout(tiny_dir):
    with safe_open(tiny_dir / "model.safetensors", "pt") as f:
        keys = set(f.keys())
        moe = {k for k in keys if k.startswith("model.language_model.layers.0.mlp.")}
        assert moe == {
            "model.language_model.layers.0.mlp.gate.weight",
            "model.language_model.layers.0.mlp.experts.gate_up_proj",
            "model.language_model.layers.0.mlp.experts.down_proj",
        }
        # transformers' in-memory layout: [E, 2I, H] and [E, H, I].
        assert f.get_slice("model.language_model.layers.0.mlp.experts.gate_up_proj").get_shape() == [16, 64, 64]
        assert f.get_slice("model.language_model.layers.0.mlp.experts.down_proj").get_shape() == [16, 64, 32]
        assert f.get_tensor("lm_head.weight").dtype == torch.bfloat16


def test_model_loads_and_runs(tiny_dir, tok):
    model, info = Qwen3VLMoeForConditionalGeneration.from_pretrained(
        tiny_dir, dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]

    prompt = tok.apply_chat_template([{"role": "user", "content": TEXT}], tokenize=False, add_generation_prompt=True)
    input_ids = tok(prompt, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        logits = model(input_ids=input_ids).logits
    assert logits.shape == (1, input_ids.shape[1], model.config.text_config.vocab_size)
    assert torch.isfinite(logits).all()
