"""The engine: validated requests in; each step, the next token of every sequence whose prompt is in the cache.

With `async_scheduling` a run of decode steps is pipelined, as vLLM V1's
async scheduling and SGLang's overlap scheduler do it: step N+1 is scheduled and launched, its input
tokens taken from step N's result on the device, before step N's tokens are read back. So the host's
work between two steps (scheduling, the step's tensors, the caller's handling of the tokens) runs
while the GPU computes, and `step()` returns each step's tokens one call later. A sequence that ends
at step N (EOS, a stop string, a cancel) has already been given step N+1: that token is dropped; one
whose last token (max_tokens) is in step N is left out of step N+1. Step N+1 may also admit whole
short text prompts that ride a decode graph after the decode rows (runner.prompt_rows): a stream's
next question then costs the running streams one larger replay, not a replay the host waited for. A
step that admits an image or a long prompt, carries a prompt chunk, needs a block it would have to
preempt for, or would fill a context waits for the step before it, so those run as without it. Tokens are
sampled on the device (sampler.py), greedy or from each request's own generator, so a sampled
request draws the same tokens either way.
"""
from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..checkpoint import TEXT_PREFIX, TextConfig, open_weights
from ..settings import (check_fields, device_setting, dtype_setting, load_format_setting, make_current,
                        resolve_device_dtype, setting)
from . import memory
from .cuda_graphs import kept_logit_rows
from .expert_parallel import ExpertShard
from .kv_cache import BlockManager, KVCache
from .memory import CPU_KV_BLOCKS, OutOfMemory
from .model import Qwen3VLMoeTextDecoder
from .routing import POLICIES, make_policy
from .multimodal import VisualInputs
from .runner import ModelRunner, is_decode
from .sampler import make_generator
from .scheduler import ScheduledBatch, Scheduler
from .sequence import FinishReason, SamplingParams, Sequence

@dataclass(frozen=True)
class EngineConfig:
    """The engine's settings; each is also a parameter of moe_decoder/config.pbtxt (`settings.py`)."""
    device: str = device_setting()
    dtype: str = dtype_setting()
    load_format: str = load_format_setting()
    block_size: int = setting(16, "tokens per paged KV-cache block", min=1)
    num_kv_blocks: int = setting(0, "KV-cache blocks; 0: as many as gpu_memory_utilization leaves after the weights "
                                    f"and a worst-case step ({CPU_KV_BLOCKS} on a CPU)", min=0)
    gpu_memory_utilization: float = setting(0.9, "share of the GPU's memory this model may take (weights, "
                                                 "activations, KV cache); the rest is the other models'",
                                            min=0.05, max=1.0)
    max_num_seqs: int = setting(64, "sequences in one decode step", min=1)
    max_num_batched_tokens: int = setting(8192, "tokens in one step: every running sequence's next token, then "
                                                "prompt chunks (chunked prefill)", min=1)
    max_new_seqs_per_step: int = setting(0, "waiting sequences admitted into a step that also carries running "
                                            "sequences' tokens (scheduler.py); 0: as many as the budget allows",
                                         min=0)
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
    prefill_graph_tokens: int = setting(2048, "on CUDA with cuda_graphs, steps that carry prompt chunks and at most "
                                              "this many tokens replay piecewise CUDA graphs around an eager "
                                              "attention (engine/prefill_graphs.py); 0: they run eagerly", min=0)
    prompt_graph_rows: int = setting(512, "on CUDA with cuda_graphs, decode graphs of up to this many rows are also "
                                          "captured above max_num_seqs for steps of short text prompts, each prompt "
                                          "token a row (engine/runner.py); max_num_seqs or less: none above it", min=0)
    async_scheduling: bool = setting(True, "pipeline decode steps (short text prompts admitted into them too): the "
                                            "next step is launched before this one's tokens are read back (engine.py)")
    expert_parallel_size: int = setting(1, "processes (GPUs: this instance's and the next N-1) that split every MoE "
                                           "layer's experts; attention and the KV cache are replicated "
                                           "(engine/parallel_engine.py)", min=1)

    def validate(self, text: TextConfig) -> None:
        check_fields(self)
        if self.max_model_len > text.max_position_embeddings:
            raise ValueError(f"max_model_len {self.max_model_len} > the model's {text.max_position_embeddings}")
        if self.num_kv_blocks and self.num_kv_blocks * self.block_size < self.max_model_len:
            raise ValueError("num_kv_blocks * block_size must hold at least one max_model_len sequence")
        if text.num_experts % self.expert_parallel_size:
            raise ValueError(f"expert_parallel_size {self.expert_parallel_size} must divide the model's "
                             f"{text.num_experts} experts")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError("max_num_batched_tokens must be >= max_num_seqs (every running sequence's token, each step)")


@dataclass
class InFlight:
    """A launched decode step whose tokens are not read back yet (async scheduling)."""
    seqs: list[Sequence]
    tokens: torch.Tensor  # [B] on the device: the next step's input ids
    host: torch.Tensor  # [B] their copy on the host, queued after the step
    copied: torch.cuda.Event | None = field(default=None)  # recorded after that copy (CUDA)
    prompts_from: float | None = None  # the step admitted prompts: perf_counter() when it was launched
    routing: torch.Tensor | None = None  # the routing sums as of this step, copied to the host with its tokens


class RequestError(ValueError):
    """A request the engine refuses; the message is meant for the client."""


class LLMEngine:
    def __init__(self, checkpoint: str | Path | None, config: EngineConfig, *, text: TextConfig | None = None,
                 store=None, policy=None, shard: ExpertShard | None = None):
        """Reads the checkpoint; benchmarks may pass the text config, a tensor store and a policy instead.
        shard: this process's experts under expert parallelism (parallel_engine.py), None: all of them."""
        self.config = config
        self.text = text or TextConfig.from_dir(checkpoint)
        config.validate(self.text)
        if config.expert_parallel_size > 1 and shard is None:
            raise ValueError("expert_parallel_size > 1: make the engine with parallel_engine.make_engine")
        self.device, self.dtype = resolve_device_dtype(config.device, config.dtype)
        make_current(self.device)  # cuda:N: loading, the memory plan and CUDA-graph capture run on this thread
        store = store or open_weights(checkpoint, config.load_format, self.device)
        policy = policy or make_policy(config.routing_policy, self.text.top_k, checkpoint, self.device,
                                       sere_primary_k=config.sere_primary_k, sere_threshold=config.sere_threshold,
                                       sere_protect=config.sere_protect, oea_k0=config.oea_k0,
                                       truncate_k=config.truncate_k,
                                       normalize=self.text.norm_topk_prob)
        try:
            with store.reading("decoder weights", (TEXT_PREFIX, "lm_head.")):
                self.model = Qwen3VLMoeTextDecoder(self.text, store, self.dtype, self.device, policy,
                                                   config.routing_min_batch, shard)
        except torch.OutOfMemoryError:
            raise OutOfMemory(f"the decoder's weights do not fit in the free GPU memory of {self.device}: "
                              "free it, or lower the other models' share (their instances, max_images)") from None
        # Steps with prompt tokens up to this size replay piecewise graphs (not under expert parallel,
        # whose steps all-reduce across processes).
        graph_tokens = (min(config.prefill_graph_tokens, config.max_num_batched_tokens)
                        if config.cuda_graphs and shard is None else 0)
        # Prompt rows ride decode graphs (runner.prompt_rows) of up to this many rows; not under expert parallel.
        prompt_rows = min(config.prompt_graph_rows, config.max_num_batched_tokens) if shard is None else 0
        num_blocks = config.num_kv_blocks or self._plan_kv_blocks(graph_tokens, prompt_rows)
        if shard is not None:  # lockstep schedulers need the same cache size in every process
            num_blocks = shard.agree_min(num_blocks)
        self.blocks = BlockManager(num_blocks, config.block_size)
        kv = KVCache(self.text.num_layers, num_blocks, config.block_size, self.text.num_kv_heads,
                     self.text.head_dim, self.dtype, self.device)
        self.runner = ModelRunner(self.model, kv, self.blocks, config.max_num_seqs, config.max_model_len,
                                  config.cuda_graphs, graph_tokens, prompt_rows)
        self.scheduler = Scheduler(self.blocks, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.max_new_seqs_per_step)
        self.eos = set(self.text.eos_token_ids)
        self._ids = itertools.count()
        self._single_process = shard is None  # expert parallel keeps its processes in lockstep on plain steps
        self._pipelined = config.async_scheduling and self._single_process
        if config.async_scheduling and shard is not None and shard.rank == 0:
            print(f"async scheduling: off with expert_parallel_size {shard.size} (its processes step in lockstep)",
                  flush=True)
        self._inflight: InFlight | None = None
        # Steps run (any kind), and those launched ahead, before the step before them was read back.
        self.steps_run = self.steps_pipelined = 0

    def _plan_kv_blocks(self, graph_tokens: int, prompt_rows: int) -> int:
        """num_kv_blocks 0: what memory.plan leaves for the cache (CPU: a fixed size)."""
        cfg = self.config
        need = -(-cfg.max_model_len // cfg.block_size)
        if self.device.type != "cuda":
            return max(CPU_KV_BLOCKS, need)
        logits = (kept_logit_rows(cfg.max_num_seqs, cfg.routing_min_batch, prompt_rows) * self.text.vocab_size * 4
                  if cfg.cuda_graphs else 0)  # float32
        mem = memory.plan(self.model, self.text, cfg.gpu_memory_utilization, cfg.max_num_batched_tokens,
                          cfg.max_model_len, cfg.max_num_seqs, cfg.block_size, self.text.deepstack_layers, graph_tokens,
                          logits)
        blocks = mem.num_blocks(memory.block_bytes(self.text, cfg.block_size, self.dtype))
        print(f"KV cache: {mem.describe()} = {blocks} blocks, {blocks * cfg.block_size} tokens", flush=True)
        if blocks < need:
            raise OutOfMemory(f"{mem.describe()}: {blocks * cfg.block_size} tokens, less than one max_model_len "
                              f"{cfg.max_model_len} sequence: raise gpu_memory_utilization, or lower max_model_len "
                              "or max_num_batched_tokens")
        return blocks

    @property
    def kv_capacity_tokens(self) -> int:
        return self.blocks.num_blocks * self.config.block_size

    def add_request(self, prompt_ids: list[int], params: SamplingParams, opt_out: bool = False,
                    visual: VisualInputs | None = None) -> Sequence:
        self.check_request(prompt_ids, params, visual)
        seq = Sequence(next(self._ids), list(prompt_ids), params, opt_out=opt_out, visual=visual,
                       arrival=time.monotonic())
        if visual is not None:
            seq.image_rows = [j for j, t in enumerate(seq.prompt_ids) if t == self.text.image_token_id]
        if not params.greedy:
            seq.generator = make_generator(params.seed, self.model.device)
        self.scheduler.add(seq)
        return seq

    def check_request(self, prompt_ids: list[int], params: SamplingParams, visual: VisualInputs | None = None) -> None:
        cfg = self.config
        if not prompt_ids:
            raise RequestError("the prompt is empty")
        if len(prompt_ids) >= cfg.max_model_len:
            kept = "" if visual is None else f", {visual.embeds.shape[0]} of them the images' kept visual tokens"
            shorter = "a shorter question" if visual is None else "fewer images or a lower visual_keep_ratio"
            raise RequestError(f"the prompt has {len(prompt_ids)} tokens{kept}; the context holds max_model_len "
                               f"{cfg.max_model_len} (prompt + at least one generated token): ask with {shorter}")
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
        if not 0 <= params.temperature < math.inf:  # NaN fails too
            raise RequestError(f"temperature must be a finite number >= 0, got {params.temperature}")
        if not 0 < params.top_p <= 1:
            raise RequestError(f"top_p must be in (0, 1], got {params.top_p}")
        if params.top_k < 0:
            raise RequestError(f"top_k must be >= 0 (0 = off), got {params.top_k}")

    def set_async_scheduling(self, on: bool) -> None:
        """Turns async scheduling on or off (benchmarks); a step in flight is still read back by the next step()."""
        self._pipelined = on and self._single_process

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
        return self.scheduler.has_work or self._inflight is not None

    @property
    def step_in_flight(self) -> bool:
        """A step is launched and its tokens not yet read back (async scheduling)."""
        return self._inflight is not None

    def abort(self, seq: Sequence) -> None:
        self.scheduler.finish(seq, FinishReason.CANCELLED)

    def step(self) -> list[tuple[Sequence, int]]:
        """One step (scheduler.py): returns (sequence, new token) for each sequence that produced one
        (a sequence in the middle of its prompt produces none); with async scheduling, the tokens of
        the step launched by the call before.

        Sequences that finished in this step have `finished` set and their blocks already freed.
        """
        if self._inflight is not None:
            return self._step_behind()
        batch = self.scheduler.schedule()
        if not batch:
            return []
        if self._pipelined and all(is_decode(seq, n) for seq, n in batch):
            self._launch(batch, None)
            return []
        results = self.runner.run(batch)
        self.steps_run += 1
        for seq, n in batch:
            seq.num_cached += n
            if seq.visual is not None and seq.num_cached >= len(seq.prompt_ids):
                seq.visual.offload()
        return self._commit(results)

    def _launch(self, batch: ScheduledBatch, input_ids: torch.Tensor | None, admits: bool = False) -> None:
        """Launches a step whose every sequence samples a token, leaving the tokens on the device: decode
        tokens, and after them (admits) whole text prompts admitted behind a step in flight."""
        started = time.perf_counter()
        tokens = self.runner.launch(batch, input_ids)
        self.steps_run += 1
        self.steps_pipelined += input_ids is not None  # a follow-up launch: its input ids never left the device
        for seq, n in batch:
            seq.num_cached += n
            seq.pending += 1
        seqs = [seq for seq, _ in batch]
        prompts_from = started if admits else None
        if tokens.is_cuda:
            host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True).copy_(tokens, non_blocking=True)
            routing = self.routing_stats.queue_copy()
            copied = torch.cuda.Event()
            copied.record(torch.cuda.current_stream(tokens.device))
            self._inflight = InFlight(seqs, tokens, host, copied, prompts_from, routing)
        else:
            self._inflight = InFlight(seqs, tokens, tokens, None, prompts_from)

    def _step_behind(self) -> list[tuple[Sequence, int]]:
        """Launches the next step where it can follow the one in flight (its decode tokens, maybe short
        prompts admitted beside them), then reads that one back."""
        prev, self._inflight = self._inflight, None
        index = [i for i, seq in enumerate(prev.seqs)  # not those whose last token is in flight
                 if not seq.finished and len(seq.output_ids) + seq.pending < seq.params.max_tokens]
        live = [prev.seqs[i] for i in index]
        ending = sum(not seq.finished for seq in prev.seqs) - len(live)
        admitted = self._follow_admissions(live, ending)
        if admitted is not None:
            try:
                batch = self.scheduler.schedule()
                if batch != [(seq, 1) for seq in live] + admitted:  # planned ahead of the scheduler: a bug if not
                    raise RuntimeError("async scheduling: the next step differs from the one planned behind "
                                       "the step in flight")
                ids = prev.tokens
                if len(index) < len(prev.seqs):  # a queued copy of the index: a blocking one would wait for prev
                    ids = ids[torch.tensor(index).to(ids.device, non_blocking=True)]
                self._launch(batch, ids, bool(admitted))
            except BaseException:  # the step in flight is still to be read back by whoever calls next
                self._inflight = prev
                raise
        return self._read_back(prev)

    def read_back(self) -> list[tuple[Sequence, int]]:
        """The tokens of the step in flight (async scheduling), launching none after it; [] when
        none is in flight. The next step() schedules as it would without async scheduling."""
        prev, self._inflight = self._inflight, None
        return [] if prev is None else self._read_back(prev)

    def _read_back(self, prev: InFlight) -> list[tuple[Sequence, int]]:
        if prev.copied is not None:
            prev.copied.synchronize()
        tokens = prev.host.tolist()
        self.routing_stats.landed(prev.routing)
        if prev.prompts_from is not None:  # a step that admitted prompts: from its inputs to its tokens here
            record = self.runner.prompt_steps["pipelined"]
            record[0] += 1
            record[1] += time.perf_counter() - prev.prompts_from
        results = []
        for seq, token in zip(prev.seqs, tokens):
            seq.pending -= 1
            if not seq.finished:  # ended after this step was launched: its token is dropped
                results.append((seq, token))
        return self._commit(results)

    def _follow_admissions(self, live: list[Sequence], ending: int) -> ScheduledBatch | None:
        """What the next step admits beside `live`'s decode tokens where that step can be launched
        behind the one in flight (`ending` others run, their last token in flight): [] none; whole text
        prompts that ride a decode graph with the decode rows (runner.rides_decode_graph). None where it
        cannot follow: someone is mid-prompt or would be preempted, a context is full, or an admission
        needs the step's inputs on the host (an image prompt, a chunk of a longer one, a step too large
        for a decode graph)."""
        sched = self.scheduler
        if not self._pipelined or not live or len(sched.running) != len(live) + ending:
            return None
        bs, new_blocks = self.blocks.block_size, 0
        for seq in live:
            if len(seq) >= self.config.max_model_len:
                return None
            new_blocks += seq.num_cached >= len(seq.block_table) * bs
        free = self.blocks.num_free - new_blocks
        if free < 0:
            return None
        admitted = sched.admissions(sched.max_num_batched_tokens - len(live), free, len(sched.running), True)
        if not admitted:
            return []
        whole_text = all(seq.visual is None and n == len(seq) for seq, n in admitted)
        return admitted if whole_text and self.runner.rides_decode_graph([(s, 1) for s in live] + admitted) else None

    def _commit(self, results: list[tuple[Sequence, int]]) -> list[tuple[Sequence, int]]:
        """Appends each new token and ends the sequences it ends."""
        now = time.monotonic()
        for seq, tok in results:
            seq.output_ids.append(tok)
            if seq.first_token_time is None:
                seq.first_token_time = now
            if tok in self.eos and not seq.params.ignore_eos:
                self.scheduler.finish(seq, FinishReason.EOS)
            elif len(seq.output_ids) >= seq.params.max_tokens or len(seq) - seq.pending >= self.config.max_model_len:
                self.scheduler.finish(seq, FinishReason.LENGTH)
        return results

    def close(self) -> None:
        """Ends what the engine started besides itself: nothing in one process (parallel_engine.py)."""

    def finish_stopped(self, seq: Sequence) -> None:
        """Called by the caller's text stream when a stop string appeared."""
        self.scheduler.finish(seq, FinishReason.STOP)
