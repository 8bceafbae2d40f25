"""Write a config-only Qwen3-VL-30B-A3B-Instruct directory: the real model's shape, no weights.

    python -m zipmoe.build.config_only --out checkpoints/qwen3-vl-30b-a3b

`zipmoe serve --checkpoint <dir> --load-format dummy` serves random weights of this shape, so the
real model's memory use, kernel shapes and speed can be measured without its ~60 GB of weights.
Files written:

  config.json               Qwen3-VL-30B-A3B-Instruct's config, values as Hugging Face ships them
  generation_config.json    its generation config (stops on <|im_end|> or <|endoftext|>)
  preprocessor_config.json  its image processor settings (patch 16, 2x2 merge, 64Ki..16Mi pixels)
  tokenizer.json, tokenizer_config.json
                            not Qwen's tokenizer: the tiny checkpoint's byte-level BPE and chat
                            template (tiny_checkpoint.build_tokenizer), its vocabulary padded with
                            filler tokens so that Qwen's special tokens get their real ids
                            (151643..151656) and the config's token ids are right
  README.md

Two builds are byte-identical; tests/test_config_only.py checks the committed copy against a build.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from tokenizers import Tokenizer
from transformers import PreTrainedTokenizerFast

from zipmoe.build import tiny_checkpoint
from zipmoe.build.tiny_checkpoint import build_tokenizer, chat_template

# Qwen's special tokens at their ids in Qwen2/2.5/3(-VL)'s tokenizer, right after its 151643
# regular tokens. (Qwen3-VL's tokenizer has more after these, tool-call / FIM / <think> tokens
# up to 151668; the serving path uses none of them.)
FIRST_SPECIAL_ID = 151643
SPECIAL_TOKENS = (
    "<|endoftext|>",       # 151643
    "<|im_start|>",        # 151644
    "<|im_end|>",          # 151645
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",    # 151652
    "<|vision_end|>",      # 151653
    "<|vision_pad|>",
    "<|image_pad|>",       # 151655
    "<|video_pad|>",       # 151656
)

CONFIG = {
    "architectures": ["Qwen3VLMoeForConditionalGeneration"],
    "model_type": "qwen3_vl_moe",
    "image_token_id": 151655,
    "video_token_id": 151656,
    "vision_start_token_id": 151652,
    "vision_end_token_id": 151653,
    "tie_word_embeddings": False,
    # As shipped. transformers 5 also reads it: without a version in config.json it takes a local
    # tokenizer for a Mistral one with a broken regex and warns.
    "transformers_version": "4.57.0.dev0",
    "text_config": {
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "decoder_sparse_step": 1,
        "dtype": "bfloat16",
        "head_dim": 128,
        "hidden_act": "silu",
        "hidden_size": 2048,
        "initializer_range": 0.02,
        "intermediate_size": 6144,
        "max_position_embeddings": 262144,
        "mlp_only_layers": [],
        "model_type": "qwen3_vl_moe_text",
        "moe_intermediate_size": 768,
        "norm_topk_prob": True,
        "num_attention_heads": 32,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "num_hidden_layers": 48,
        "num_key_value_heads": 4,
        "rms_norm_eps": 1e-06,
        # transformers 4.x names; transformers 5 reads them into rope_parameters.
        "rope_scaling": {"mrope_interleaved": True, "mrope_section": [24, 20, 20], "rope_type": "default"},
        "rope_theta": 5000000,
        "use_cache": True,
        "vocab_size": 151936,
    },
    "vision_config": {
        "deepstack_visual_indexes": [8, 16, 24],
        "depth": 27,
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_size": 1152,
        "in_channels": 3,
        "initializer_range": 0.02,
        "intermediate_size": 4304,
        "model_type": "qwen3_vl_moe",
        "num_heads": 16,
        "num_position_embeddings": 2304,
        "out_hidden_size": 2048,
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
    },
}

GENERATION_CONFIG = {
    "bos_token_id": 151643,
    "eos_token_id": [151645, 151643],  # <|im_end|>, <|endoftext|>
    "pad_token_id": 151643,
    # The Instruct model's sampling defaults; zipmoe's engine does not read them.
    "do_sample": True,
    "top_k": 20,
    "top_p": 0.8,
    "temperature": 0.7,
    "repetition_penalty": 1.0,
}

# Qwen3-VL's image processor (patch 16, 2x2 merge) at its real pixel range, 256x256 .. 4096x4096.
PREPROCESSOR_CONFIG = {**tiny_checkpoint.PREPROCESSOR_CONFIG, "image_processor_type": "Qwen2VLImageProcessorFast",
                       "size": {"shortest_edge": 65536, "longest_edge": 16777216}}

README = """\
# Qwen3-VL-30B-A3B-Instruct, config only

The real model's shape (48 layers, 128 experts, top-8; 27-layer vision tower) with **no weights**:
`config.json`, `generation_config.json` and `preprocessor_config.json` as Hugging Face ships them,
and a stand-in tokenizer whose special tokens sit at Qwen's real ids (its regular vocabulary is the
tiny checkpoint's BPE padded with `<|filler_N|>` tokens that no text encodes to).

Serve it with random weights of the real shape:

    zipmoe serve --checkpoint checkpoints/qwen3-vl-30b-a3b --load-format dummy

Made by (deterministic; tests/test_config_only.py checks this copy against a fresh build):

    python -m zipmoe.build.config_only --out checkpoints/qwen3-vl-30b-a3b

A real Qwen3-VL-30B-A3B-Instruct directory from Hugging Face is served the same way, without
`--load-format`: `zipmoe serve --checkpoint path/to/Qwen3-VL-30B-A3B-Instruct`.
"""


def _json(obj: dict) -> str:
    return json.dumps(obj, indent=2, sort_keys=True) + "\n"


def filler(i: int) -> str:
    """Vocabulary entry `i` between the learned BPE tokens and the special tokens. Unreachable: no
    merge builds it, and the byte-level pre-tokenizer never yields a piece mixing letters and
    punctuation. All its characters are byte-level ones, so it decodes to the text itself."""
    return f"<|filler_{i}|>"


def build_qwen_tokenizer(out: Path) -> PreTrainedTokenizerFast:
    """tiny_checkpoint's tokenizer with SPECIAL_TOKENS at Qwen's ids. `tokenizers` numbers added
    tokens after the model's vocabulary (ids written in tokenizer.json are ignored), so the BPE
    vocabulary is padded with fillers up to FIRST_SPECIAL_ID."""
    with tempfile.TemporaryDirectory() as tmp:
        learned = build_tokenizer(Path(tmp))  # byte-level BPE on tiny_checkpoint._corpus()
    spec = json.loads(learned.backend_tokenizer.to_str())
    spec["added_tokens"] = []  # the tiny checkpoint's specials, at its own ids
    vocab = spec["model"]["vocab"]
    assert sorted(vocab.values()) == list(range(len(vocab))), "BPE ids must be 0..n-1"
    vocab.update({filler(i): i for i in range(len(vocab), FIRST_SPECIAL_ID)})
    backend = Tokenizer.from_str(json.dumps(spec))
    backend.add_special_tokens(list(SPECIAL_TOKENS))

    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        model_max_length=CONFIG["text_config"]["max_position_embeddings"],
        clean_up_tokenization_spaces=False,
        chat_template=chat_template(),
    )
    tok.save_pretrained(out, save_jinja_files=False)
    # Compact: the 150k-entry vocabulary, one line per entry, would add ~1 MB of indentation.
    tok.backend_tokenizer.save(str(out / "tokenizer.json"), pretty=False)
    return tok


def build_config_only(out_dir: str | Path) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(_json(CONFIG))
    (out / "generation_config.json").write_text(_json(GENERATION_CONFIG))
    (out / "preprocessor_config.json").write_text(_json(PREPROCESSOR_CONFIG))
    (out / "README.md").write_text(README)
    tok = build_qwen_tokenizer(out)
    ids = tok.convert_tokens_to_ids(list(SPECIAL_TOKENS))
    assert ids == list(range(FIRST_SPECIAL_ID, FIRST_SPECIAL_ID + len(SPECIAL_TOKENS))), ids
    print(f"{out}: config for Qwen3-VL-30B-A3B-Instruct, tokenizer of {len(tok)} tokens")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="output directory")
    build_config_only(parser.parse_args().out)


if __name__ == "__main__":
    main()
