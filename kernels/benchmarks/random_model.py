"""Random weights of Qwen3-30B-A3B's text decoder, made on the device, served like a checkpoint.

No pretrained weights can be downloaded here, and timing only needs the shapes. Expert
popularity is skewed the way trained routers are: every token embedding shares one direction,
so each expert's router row gets a fixed bias towards it (the benchmarks report the resulting
unions). Output projections are scaled down (GPT-2 style) so the shared direction survives the
residual stream through 48 layers.
"""
from __future__ import annotations

import torch

from zipmoe.checkpoint import TEXT_PREFIX, TextConfig

QWEN3_30B_A3B = TextConfig(
    vocab_size=151936, hidden_size=2048, num_layers=48, num_heads=32, num_kv_heads=4, head_dim=128,
    num_experts=128, top_k=8, moe_intermediate_size=768, intermediate_size=6144, moe_layers=(True,) * 48,
    rms_norm_eps=1e-6, rope_theta=1e6, mrope_section=(24, 20, 20), max_position_embeddings=262144,
    norm_topk_prob=True, tie_word_embeddings=False, eos_token_ids=(151645,), image_token_id=151655)


class RandomStore:
    """`TensorStore`'s interface (get, in) over random bf16 tensors made on first use."""

    def __init__(self, cfg: TextConfig, device: torch.device, seed: int = 0, skew: float = 1.0):
        self.cfg, self.device = cfg, device
        self.gen = torch.Generator(device=device).manual_seed(seed)
        self.skew = skew

    def __contains__(self, name: str) -> bool:
        return name == "lm_head.weight" or name.startswith(TEXT_PREFIX)

    def _randn(self, *shape, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=self.gen, device=self.device, dtype=torch.bfloat16) * std

    def get(self, name: str) -> torch.Tensor:
        c = self.cfg
        H, D, E, I = c.hidden_size, c.head_dim, c.num_experts, c.moe_intermediate_size
        out_std = 0.02 / (2 * c.num_layers) ** 0.5
        if name.endswith("norm.weight"):
            return torch.ones(D if "q_norm" in name or "k_norm" in name else H, dtype=torch.bfloat16,
                              device=self.device)
        if name.endswith("embed_tokens.weight"):
            shared = torch.randn(H, generator=self.gen, device=self.device) * self.skew
            return (torch.randn(c.vocab_size, H, generator=self.gen, device=self.device) + shared).bfloat16()
        shapes = {
            "lm_head.weight": ((c.vocab_size, H), 0.02),
            "self_attn.q_proj.weight": ((c.num_heads * D, H), 0.02),
            "self_attn.k_proj.weight": ((c.num_kv_heads * D, H), 0.02),
            "self_attn.v_proj.weight": ((c.num_kv_heads * D, H), 0.02),
            "self_attn.o_proj.weight": ((H, c.num_heads * D), out_std),
            "mlp.gate.weight": ((E, H), H ** -0.5),
            "mlp.experts.gate_up_proj": ((E, 2 * I, H), 0.02),
            "mlp.experts.down_proj": ((E, H, I), out_std),
        }
        for suffix, (shape, std) in shapes.items():
            if name.endswith(suffix):
                return self._randn(*shape, std=std)
        raise KeyError(name)


def decoder_bytes(cfg: TextConfig, union_per_layer: float, batch: int, context: int) -> int:
    """Bytes one decode step must read: attention and router weights, the union's experts, the
    LM head, and every sequence's K/V (bf16)."""
    H, D = cfg.hidden_size, cfg.head_dim
    attn = (2 * cfg.num_heads * D * H + 2 * cfg.num_kv_heads * D * H) * 2
    router = cfg.num_experts * H * 2
    expert = 3 * cfg.moe_intermediate_size * H * 2
    kv = batch * context * 2 * cfg.num_kv_heads * D * 2
    per_layer = attn + router + union_per_layer * expert + kv
    return int(cfg.num_layers * per_layer + cfg.vocab_size * H * 2)
