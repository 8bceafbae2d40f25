"""Reading a Hugging Face Qwen3-VL-MoE directory: the text config and tensors by name."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

TEXT_PREFIX = "model.language_model."


@dataclass(frozen=True)
class TextConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_experts: int
    top_k: int
    moe_intermediate_size: int
    intermediate_size: int
    moe_layers: tuple[bool, ...]
    rms_norm_eps: float
    rope_theta: float
    mrope_section: tuple[int, int, int]
    max_position_embeddings: int
    norm_topk_prob: bool
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...]
    image_token_id: int | None

    @classmethod
    def from_dir(cls, path: str | Path) -> "TextConfig":
        path = Path(path)
        raw = json.loads((path / "config.json").read_text())
        text = raw.get("text_config", raw)
        rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
        head_dim = text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]
        n_layers = text["num_hidden_layers"]
        mlp_only = set(text.get("mlp_only_layers") or [])
        step = text.get("decoder_sparse_step", 1)
        num_experts = text.get("num_experts", text.get("num_local_experts", 0))
        moe_layers = tuple(
            i not in mlp_only and num_experts > 0 and (i + 1) % step == 0 for i in range(n_layers)
        )
        eos = _eos_ids(path, text, raw)
        return cls(
            vocab_size=text["vocab_size"],
            hidden_size=text["hidden_size"],
            num_layers=n_layers,
            num_heads=text["num_attention_heads"],
            num_kv_heads=text.get("num_key_value_heads") or text["num_attention_heads"],
            head_dim=head_dim,
            num_experts=num_experts,
            top_k=text.get("num_experts_per_tok", 0),
            moe_intermediate_size=text.get("moe_intermediate_size", 0),
            intermediate_size=text.get("intermediate_size", 0),
            moe_layers=moe_layers,
            rms_norm_eps=text.get("rms_norm_eps", 1e-6),
            rope_theta=rope.get("rope_theta", text.get("rope_theta", 1e6)),
            mrope_section=tuple(rope.get("mrope_section", [24, 20, 20])),
            max_position_embeddings=text.get("max_position_embeddings", 32768),
            norm_topk_prob=text.get("norm_topk_prob", True),
            tie_word_embeddings=raw.get("tie_word_embeddings", text.get("tie_word_embeddings", False)),
            eos_token_ids=eos,
            image_token_id=raw.get("image_token_id"),
        )


def _eos_ids(path: Path, text: dict, raw: dict) -> tuple[int, ...]:
    """End-of-sequence ids: generation_config.json wins (it lists <|im_end|> and <|endoftext|>)."""
    gen = path / "generation_config.json"
    eos = None
    if gen.exists():
        eos = json.loads(gen.read_text()).get("eos_token_id")
    if eos is None:
        eos = text.get("eos_token_id", raw.get("eos_token_id"))
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (eos,)


class TensorStore:
    """Lazy access to every tensor of the checkpoint's safetensors shards, by name."""

    def __init__(self, path: str | Path):
        path = Path(path)
        # sere.safetensors (SERE calibration) sits beside the weights but is not part of them.
        files = sorted(f for f in path.glob("*.safetensors") if f.name != "sere.safetensors")
        if not files:
            raise FileNotFoundError(f"no *.safetensors in {path}")
        self._where: dict[str, Path] = {}
        for f in files:
            with safe_open(f, "pt") as h:
                for k in h.keys():
                    self._where[k] = f
        self._handles: dict[Path, object] = {}

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def get(self, name: str) -> torch.Tensor:
        if name not in self._where:
            raise KeyError(f"checkpoint has no tensor {name!r}")
        f = self._where[name]
        if f not in self._handles:
            self._handles[f] = safe_open(f, "pt")
        return self._handles[f].get_tensor(name)
