"""Reading a Hugging Face Qwen3-VL-MoE directory: the text config, and tensors by name (or dummy ones)."""
from __future__ import annotations

import json
import math
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from .settings import LOAD_FORMATS

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
    deepstack_layers: int = 0  # decoder layers that get DeepStack features added to image tokens

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
            deepstack_layers=len((raw.get("vision_config") or {}).get("deepstack_visual_indexes") or ()),
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


INDEX = "model.safetensors.index.json"  # Hugging Face's map of a sharded checkpoint: tensor name -> shard


def _safetensors_device(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda:{device.index if device.index is not None else torch.cuda.current_device()}"
    return str(device)


class TensorStore:
    """The tensors of a checkpoint's safetensors files by name, read straight to `device`.

    A sharded checkpoint (model-0000N-of-0000M.safetensors) is read through its index file; a
    single file or a folder of shards without one, by listing. Each tensor goes from its file's
    memory map to the device (safetensors' own loader): no copy of the whole model in host memory.
    `reading()` shows a progress bar over the bytes a caller is about to read and logs the rate.
    """

    def __init__(self, path: str | Path, device: str | torch.device = "cpu"):
        path = Path(path)
        self.device = torch.device(device)
        index = path / INDEX
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            self._where = {name: path / shard for name, shard in weight_map.items()}
            absent = sorted({f.name for f in self._where.values() if not f.exists()})
            if absent:
                raise FileNotFoundError(f"{index} names shards that are not there: {', '.join(absent)}")
        else:
            # sere.safetensors (SERE calibration) sits beside the weights but is not part of them.
            files = sorted(f for f in path.glob("*.safetensors") if f.name != "sere.safetensors")
            if not files:
                raise FileNotFoundError(f"no *.safetensors in {path}")
            self._where = {}
            for f in files:
                with safe_open(f, "pt") as h:
                    self._where.update(dict.fromkeys(h.keys(), f))
        self._handles: dict[Path, object] = {}
        self._bar = None

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def names(self, prefixes: tuple[str, ...]) -> list[str]:
        return [n for n in self._where if n.startswith(prefixes)]

    def _handle(self, f: Path):
        if f not in self._handles:
            self._handles[f] = safe_open(f, "pt", device=_safetensors_device(self.device))
        return self._handles[f]

    def nbytes(self, prefixes: tuple[str, ...]) -> int:
        """Bytes of the tensors whose names start with one of `prefixes` (from the files' headers)."""
        total = 0
        for name in self.names(prefixes):
            meta = self._handle(self._where[name]).get_slice(name)
            total += math.prod(meta.get_shape()) * _DTYPE_BYTES[meta.get_dtype()]
        return total

    def get(self, name: str) -> torch.Tensor:
        if name not in self._where:
            raise KeyError(f"checkpoint has no tensor {name!r}")
        tensor = self._handle(self._where[name]).get_tensor(name)
        if self._bar is not None:
            self._bar.update(tensor.numel() * tensor.element_size())
        return tensor

    @contextmanager
    def reading(self, what: str, prefixes: tuple[str, ...]):
        """Progress over the bytes of `prefixes` while the caller reads them; logs size, time and rate."""
        total = self.nbytes(prefixes)
        start = time.perf_counter()
        with tqdm(total=total, unit="B", unit_scale=True, desc=f"loading {what}", mininterval=1.0) as self._bar:
            try:
                yield self
            finally:
                self._bar = None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - start
        print(f"{what}: {total / 1e9:.2f} GB from {len({self._where[n] for n in self.names(prefixes)})} file(s) "
              f"to {self.device} in {seconds:.1f} s ({total / 1e9 / max(seconds, 1e-9):.2f} GB/s)", flush=True)


_DTYPE_BYTES = {"BF16": 2, "F16": 2, "F32": 4, "F64": 8, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
                "F8_E4M3": 1, "F8_E5M2": 1}


def open_weights(checkpoint: str | Path, load_format: str, device: torch.device):
    """The weights a model reads: the checkpoint's safetensors (auto), or deterministic random
    tensors of its config.json's shapes made on the device (dummy, for benchmarks)."""
    if load_format == "dummy":
        from .dummy_weights import DummyWeights

        return DummyWeights(checkpoint, device)
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {load_format!r}")
    return TensorStore(checkpoint, device)
