"""The engine: validated requests in, one token per running sequence out, every step."""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..checkpoint import TensorStore, TextConfig
from ..settings import DTYPE_CHOICES, DTYPE_NAMES, check_fields, resolve_device_dtype, setting
from .kv_cache import BlockManager, KVCache
from .model import Qwen3VLMoeTextDecoder
from .routing import POLICIES, make_policy
from .multimodal import VisualInputs
from .runner import ModelRunner
from .sampler import make_generator
from .scheduler import Scheduler
from .sequence import FinishReason, SamplingParams, Sequence

DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}


@dataclass(frozen=True)
class EngineConfig:
    """The engine's settings; each is also a parameter of moe_decoder/config.pbtxt (`settings.py`)."""
    device: str = setting("auto", "cpu, cuda or cuda:N; auto = cuda when a GPU is visible, else cpu")
    dtype: str = setting("auto", "weights and activations; auto = bfloat16 on cuda, float32 on cpu",
                         choices=DTYPE_CHOICES)
    block_size: int = setting(16, "tokens per paged KV-cache block", min=1)
    num_kv_blocks: int = setting(1024, "KV-cache blocks in all", min=1)
    max_num_seqs: int = setting(64, "sequences in one decode step", min=1)
    max_num_batched_tokens: int = setting(8192, "prompt tokens in one prefill step", min=1)
    max_model_len: int = setting(4096, "context length: prompt + generated tokens", min=2)
    max_tokens_cap: int = setting(1024, "requests asking for more new tokens are refused", min=1)
    routing_policy: str = setting("topk", "decode-step routing (prefill keeps the router's top-K)",
                                  choices=POLICIES)
    sere_primary_k: int = setting(2, "sere: each token's first K' experts form the batch's primary set", min=1)
    sere_threshold: float = setting(0.5, "sere: re-route only to a primary at least this similar")
    sere_protect: bool = setting(True, "sere: key experts (calibrated) are never re-routed")
    oea_k0: int = setting(2, "oea: experts every token keeps", min=1)
    truncate_k: int = setting(2, "truncate: experts every token keeps (a baseline)", min=1)
    routing_min_batch: int = setting(1, "decode batches smaller than this keep plain top-K", min=1)
    cuda_graphs: bool = setting(True, "on CUDA, replay decode steps from per-batch-size CUDA graphs")

    def validate(self, text: TextConfig) -> None:
        check_fields(self)
        if self.max_model_len > text.max_position_embeddings:
            raise ValueError(f"max_model_len {self.max_model_len} > the model's {text.max_position_embeddings}")
        if self.num_kv_blocks * self.block_size < self.max_model_len:
            raise ValueError("num_kv_blocks * block_size must hold at least one max_model_len sequence")
        if self.max_num_batched_tokens < self.max_model_len:
            raise ValueError("max_num_batched_tokens must be >= max_model_len (a full prompt is one prefill)")


class RequestError(ValueError):
    """A request the engine refuses; the message is meant for the client."""


class LLMEngine:
    def __init__(self, checkpoint: str | Path | None, config: EngineConfig, *, text: TextConfig | None = None,
                 store=None, policy=None):
        """Reads the checkpoint; benchmarks may pass the text config, a tensor store and a policy instead."""
        self.config = config
        self.text = text or TextConfig.from_dir(checkpoint)
        config.validate(self.text)
        device, dtype = resolve_device_dtype(config.device, config.dtype)
        self.device, self.dtype = torch.device(device), DTYPES[dtype]
        store = store or TensorStore(checkpoint)
        policy = policy or make_policy(config.routing_policy, self.text.top_k, checkpoint, self.device,
                                       sere_primary_k=config.sere_primary_k, sere_threshold=config.sere_threshold,
                                       sere_protect=config.sere_protect, oea_k0=config.oea_k0,
                                       truncate_k=config.truncate_k,
                                       normalize=self.text.norm_topk_prob)
        self.model = Qwen3VLMoeTextDecoder(self.text, store, self.dtype, self.device, policy, config.routing_min_batch)
        self.blocks = BlockManager(config.num_kv_blocks, config.block_size)
        kv = KVCache(self.text.num_layers, config.num_kv_blocks, config.block_size, self.text.num_kv_heads,
                     self.text.head_dim, self.dtype, self.device)
        self.runner = ModelRunner(self.model, kv, self.blocks, config.max_num_seqs, config.max_model_len,
                                  config.cuda_graphs)
        self.scheduler = Scheduler(self.blocks, config.max_num_seqs, config.max_num_batched_tokens)
        self.eos = set(self.text.eos_token_ids)
        self._ids = itertools.count()

    def add_request(self, prompt_ids: list[int], params: SamplingParams, opt_out: bool = False,
                    visual: VisualInputs | None = None) -> Sequence:
        self.check_request(prompt_ids, params, visual)
        seq = Sequence(next(self._ids), list(prompt_ids), params, opt_out=opt_out, visual=visual,
                       arrival=time.monotonic())
        if not params.greedy:
            seq.generator = make_generator(params.seed, self.model.device)
        self.scheduler.add(seq)
        return seq

    def check_request(self, prompt_ids: list[int], params: SamplingParams, visual: VisualInputs | None = None) -> None:
        cfg = self.config
        if not prompt_ids:
            raise RequestError("the prompt is empty")
        if len(prompt_ids) >= cfg.max_model_len:
            raise RequestError(f"the prompt has {len(prompt_ids)} tokens; the context holds {cfg.max_model_len} "
                               "(prompt + at least one generated token)")
        bad = [t for t in prompt_ids if not 0 <= t < self.text.vocab_size]
        if bad:
            raise RequestError(f"token id {bad[0]} is outside the vocabulary (size {self.text.vocab_size})")
        image_tokens = sum(t == self.text.image_token_id for t in prompt_ids)
        have = 0 if visual is None else visual.embeds.shape[0]
        if image_tokens != have:
            raise RequestError(f"the prompt has {image_tokens} image tokens but {have} visual embeddings")
        if visual is not None and visual.embeds.shape[-1] != self.text.hidden_size:
            raise RequestError(f"visual embeddings have width {visual.embeds.shape[-1]}, "
                               f"the model's hidden size is {self.text.hidden_size}")
        if not 1 <= params.max_tokens <= cfg.max_tokens_cap:
            raise RequestError(f"max_tokens must be in [1, {cfg.max_tokens_cap}], got {params.max_tokens}")
        if params.temperature < 0 or params.temperature != params.temperature:
            raise RequestError(f"temperature must be >= 0, got {params.temperature}")
        if not 0 < params.top_p <= 1:
            raise RequestError(f"top_p must be in (0, 1], got {params.top_p}")
        if params.top_k < 0:
            raise RequestError(f"top_k must be >= 0 (0 = off), got {params.top_k}")

    def set_routing_policy(self, policy) -> None:
        """Swaps the decode routing policy (benchmarks, tests); re-captures the CUDA graphs, which hold it."""
        self.model.policy = policy
        self.runner.capture_graphs()

    @property
    def routing_stats(self):
        """Decode routing counters (mean expert union before/after re-routing), kept by the runner."""
        return self.runner.routing_stats

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    def abort(self, seq: Sequence) -> None:
        self.scheduler.finish(seq, FinishReason.CANCELLED)

    def step(self) -> list[tuple[Sequence, int]]:
        """One prefill or decode step; returns (sequence, new token) for each sequence that ran.

        Sequences that finished in this step have `finished` set and their blocks already freed.
        """
        seqs, is_prefill = self.scheduler.schedule()
        if not seqs:
            return []
        tokens = self.runner.run(seqs, is_prefill)
        now = time.monotonic()
        for seq, tok in zip(seqs, tokens):
            seq.num_cached = len(seq)
            seq.output_ids.append(tok)
            if seq.first_token_time is None:
                seq.first_token_time = now
            if tok in self.eos and not seq.params.ignore_eos:
                self.scheduler.finish(seq, FinishReason.EOS)
            elif len(seq.output_ids) >= seq.params.max_tokens or len(seq) >= self.config.max_model_len:
                self.scheduler.finish(seq, FinishReason.LENGTH)
        return list(zip(seqs, tokens))

    def finish_stopped(self, seq: Sequence) -> None:
        """Called by the caller's text stream when a stop string appeared."""
        self.scheduler.finish(seq, FinishReason.STOP)
