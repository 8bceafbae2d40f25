"""Dummy weights: deterministic random tensors of a checkpoint's config.json shapes, made on the device.

`load_format: dummy` (vLLM's `--load-format dummy`): serve and measure a model of the real size
when no weights can be had. The names and shapes are those of transformers' own
`Qwen3VLMoeForConditionalGeneration` for the config (built on the meta device, so nothing is
allocated), so every loader reads a dummy checkpoint exactly as it reads a real one.

Each tensor is drawn from a generator seeded by (seed, its name): the same tensor whatever the
order of reads, so the decoder, the vision tower and `zipmoe calibrate` see one model. The scales
keep activations finite through 48 layers and make routing look trained rather than uniform:
- every token embedding shares one direction, so each expert's router row gets a fixed bias
  towards it and some experts are chosen far more often than others (as in trained MoEs);
- output projections (attention out, expert down) are scaled down by sqrt(2 * layers), GPT-2
  style, so the shared direction survives the residual stream;
- the vision tower uses its config's initializer_range, norms are 1 and biases 0.
"""
from __future__ import annotations

import zlib
from contextlib import contextmanager
from pathlib import Path

import torch

from .checkpoint import TEXT_PREFIX


class DummyWeights:
    """TensorStore's interface (get, in, names, nbytes, reading) over made-up tensors."""

    def __init__(self, checkpoint: str | Path, device: torch.device, seed: int = 0, skew: float = 1.0):
        from transformers import Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration

        config = Qwen3VLMoeConfig.from_pretrained(checkpoint)
        with torch.device("meta"):
            model = Qwen3VLMoeForConditionalGeneration(config)
        self.shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
        self.text, self.vision_std = config.text_config, config.vision_config.initializer_range
        self.device, self.seed, self.skew = torch.device(device), seed, skew

    def __contains__(self, name: str) -> bool:
        return name in self.shapes

    def names(self, prefixes: tuple[str, ...]) -> list[str]:
        return [n for n in self.shapes if n.startswith(prefixes)]

    def nbytes(self, prefixes: tuple[str, ...]) -> int:
        return sum(torch.Size(self.shapes[n]).numel() * 2 for n in self.names(prefixes))

    @contextmanager
    def reading(self, what: str, prefixes: tuple[str, ...]):
        print(f"{what}: dummy weights ({self.nbytes(prefixes) / 1e9:.2f} GB of bf16) made on {self.device}", flush=True)
        yield self

    def _randn(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        gen = torch.Generator(device=self.device).manual_seed(self.seed * 1_000_003 + zlib.crc32(name.encode()))
        return torch.randn(shape, generator=gen, device=self.device, dtype=torch.bfloat16)

    def get(self, name: str) -> torch.Tensor:
        if name not in self.shapes:
            raise KeyError(f"the config has no tensor {name!r}")
        shape = self.shapes[name]
        if name.endswith(".bias"):
            return torch.zeros(shape, dtype=torch.bfloat16, device=self.device)
        if "norm" in name and len(shape) == 1:
            return torch.ones(shape, dtype=torch.bfloat16, device=self.device)
        if not name.startswith((TEXT_PREFIX, "lm_head.")):
            return self._randn(name, shape) * self.vision_std
        if name.endswith("embed_tokens.weight"):
            shared = self._randn("shared direction", shape[1:]) * self.skew
            return self._randn(name, shape) + shared
        return self._randn(name, shape) * self._text_std(name)

    def _text_std(self, name: str) -> float:
        if name.endswith("mlp.gate.weight"):  # router: logits of unit scale
            return self.text.hidden_size ** -0.5
        if name.endswith(("o_proj.weight", "down_proj", "down_proj.weight")):
            return 0.02 / (2 * self.text.num_hidden_layers) ** 0.5
        return 0.02
