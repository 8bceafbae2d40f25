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
- the experts of a layer come in groups of EXPERT_GROUP that share most of their weights (each
  expert = the group's component + a smaller one of its own), as trained MoEs have clusters of
  experts that compute alike: random experts would all be equally unlike, and SERE, which
  re-routes only to a similar enough expert, would have nothing to do. Calibrated (`zipmoe
  calibrate --load-format dummy`, Frobenius similarity) on the tiny config this gives 0.62-0.75
  inside a group (mean 0.68) and 0.00-0.12 across groups: at rho 0.5 SERE moves a slot only
  to an expert of its own group;
- the vision tower uses its config's initializer_range, norms are 1 and biases 0.
"""
from __future__ import annotations

import zlib
from contextlib import contextmanager
from pathlib import Path

import torch

from .checkpoint import TEXT_PREFIX


EXPERT_GROUP = 8  # experts per group of alike experts
OWN_SHARE = 0.2  # share of an expert's weights (in standard deviation) that is its own; the rest is its group's


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
        if ".mlp.experts." in name:
            return self._grouped_experts(name, shape) * self._text_std(name)
        return self._randn(name, shape) * self._text_std(name)

    def _grouped_experts(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """[E, out, in] with expert e = sqrt(1 - OWN_SHARE^2) * group(e // EXPERT_GROUP) + OWN_SHARE * own(e):
        unit variance, and two experts of one group differ by OWN_SHARE of what two strangers do."""
        experts = shape[0]
        groups = -(-experts // EXPERT_GROUP)
        common = self._randn(name + " groups", (groups, *shape[1:]))
        common = common.repeat_interleave(EXPERT_GROUP, dim=0)[:experts]
        return common * (1 - OWN_SHARE ** 2) ** 0.5 + self._randn(name, shape) * OWN_SHARE

    def _text_std(self, name: str) -> float:
        if name.endswith("mlp.gate.weight"):  # router: logits of unit scale
            return self.text.hidden_size ** -0.5
        if name.endswith(("o_proj.weight", "down_proj", "down_proj.weight")):
            return 0.02 / (2 * self.text.num_hidden_layers) ** 0.5
        return 0.02
