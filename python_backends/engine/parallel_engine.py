"""Expert parallelism across processes: N engines in lockstep, each holding 1/N of every MoE layer's experts.

Rank 0 is the engine its caller talks to: `ExpertParallelEngine`, an LLMEngine that starts N-1
worker processes (ranks 1..N-1, GPUs base+1..base+N-1 after its own) and sends them, in order, every
call that changes the engine's state: add_request, abort, finish_stopped, and each step. Each worker
runs an ordinary LLMEngine over the same calls. The processes then make the same scheduling
decisions, lay out the same KV cache and produce the same tokens. The same tokens follow because
every process holds the same hidden states: the only tensors that cross between them are each MoE
layer's partial outputs, summed by one all-reduce (expert_parallel.py).

Commands cross once per step, as one list broadcast over a gloo group (host memory); a request's
visual features go with its add command, copied to the host. A sampled request without a seed gets
one here, so that every process draws the same tokens. The routing policy is fixed when the engine
starts; swapping it later is refused, because the CUDA graphs of all processes would have to be
captured again together.
"""
from __future__ import annotations

import dataclasses
import os
import random
import shutil
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..checkpoint import TextConfig
from ..ports import free_port
from ..settings import resolve_device_dtype
from .engine import EngineConfig, LLMEngine
from .expert_parallel import ExpertShard
from .multimodal import VisualInputs
from .sequence import SamplingParams, Sequence

JOIN_TIMEOUT_S = 60.0


def _python() -> str:
    """The interpreter the workers start with: this one; inside Triton's Python-backend stub, whose
    sys.executable is the stub binary, the python3 first on PATH (the one the stub itself embeds)."""
    if Path(sys.executable).name.startswith("python"):
        return sys.executable
    return shutil.which("python3") or sys.executable


def _rank_setup(checkpoint, config: EngineConfig, rank: int, size: int, port: int):
    """(this rank's config, its expert shard, the gloo group that carries the commands). Rank r runs
    on GPU base + r, base being the GPU rank 0's config names; on a CPU all ranks use the CPU."""
    device, _ = resolve_device_dtype(config.device, config.dtype)
    if device.type == "cuda":
        device = torch.device("cuda", (device.index or 0) + rank)
        torch.cuda.set_device(device)  # NCCL's communicator is made on the current device
        config = dataclasses.replace(config, device=str(device))
    else:  # N processes computing at once share the cores: more threads than cores spin against each other
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=size)
    shard = ExpertShard(rank, size, TextConfig.from_dir(checkpoint).num_experts)
    return config, shard, dist.new_group(backend="gloo")


def _on_host(visual: VisualInputs | None) -> VisualInputs | None:
    if visual is None:
        return None
    return VisualInputs(visual.embeds.cpu(), None if visual.deepstack is None else visual.deepstack.cpu(),
                        visual.positions.cpu(), visual.rope_delta)


def _worker(rank: int, size: int, port: int, checkpoint: str, config: EngineConfig) -> None:
    """Ranks 1..N-1: an engine that does what rank 0's commands say, until told to exit."""
    config, shard, control = _rank_setup(checkpoint, config, rank, size, port)
    engine = LLMEngine(checkpoint, config, shard=shard)
    seqs: dict[int, Sequence] = {}
    try:
        while True:
            box = [None]
            dist.broadcast_object_list(box, src=0, group=control)
            for command, *args in box[0]:
                if command == "add":
                    seq = engine.add_request(*args)
                    seqs[seq.seq_id] = seq
                elif command == "abort" and args[0] in seqs:
                    engine.abort(seqs[args[0]])
                elif command == "stop" and args[0] in seqs:
                    engine.finish_stopped(seqs[args[0]])
                elif command == "step":
                    engine.step()
                    for seq_id in [i for i, s in seqs.items() if s.finished]:
                        del seqs[seq_id]
                elif command == "exit":
                    return
    finally:
        dist.destroy_process_group()


def make_engine(checkpoint: str | Path, config: EngineConfig) -> LLMEngine:
    """The engine `config` asks for: one process, or `expert_parallel_size` of them."""
    if config.expert_parallel_size > 1:
        return ExpertParallelEngine(checkpoint, config)
    return LLMEngine(checkpoint, config)


class ExpertParallelEngine(LLMEngine):
    """An LLMEngine over config.expert_parallel_size processes (this one is rank 0). close() ends them."""

    def __init__(self, checkpoint: str | Path, config: EngineConfig):
        if config.expert_parallel_size < 2:
            raise ValueError(f"expert_parallel_size must be >= 2 here, got {config.expert_parallel_size}")
        checkpoint, size, port = str(checkpoint), config.expert_parallel_size, free_port()
        ctx = mp.get_context("spawn")  # a fresh interpreter per rank: no CUDA state inherited from this one
        ctx.set_executable(_python())
        self._workers = [ctx.Process(target=_worker, args=(r, size, port, checkpoint, config), daemon=True,
                                     name=f"zipmoe-expert-rank{r}") for r in range(1, size)]
        for w in self._workers:
            w.start()
        self._pending: list[tuple] = []
        try:
            config, shard, self._control = _rank_setup(checkpoint, config, 0, size, port)
            super().__init__(checkpoint, config, shard=shard)
        except BaseException:
            self._kill_workers()
            raise

    def add_request(self, prompt_ids: list[int], params: SamplingParams, opt_out: bool = False,
                    visual: VisualInputs | None = None) -> Sequence:
        self.check_request(prompt_ids, params, visual)  # a refused request never reaches the workers
        if not params.greedy and params.seed is None:
            params = dataclasses.replace(params, seed=random.getrandbits(63))
        self._pending.append(("add", list(prompt_ids), params, opt_out, _on_host(visual)))
        return super().add_request(prompt_ids, params, opt_out, visual)

    def abort(self, seq: Sequence) -> None:
        self._pending.append(("abort", seq.seq_id))
        super().abort(seq)

    def finish_stopped(self, seq: Sequence) -> None:
        self._pending.append(("stop", seq.seq_id))
        super().finish_stopped(seq)

    def step(self) -> list[tuple[Sequence, int]]:
        self._send(self._pending + [("step",)])
        self._pending = []
        return super().step()

    def set_routing_policy(self, policy) -> None:
        raise NotImplementedError("under expert parallelism the routing policy is fixed when the engine starts")

    def _send(self, commands: list[tuple]) -> None:
        dist.broadcast_object_list([commands], src=0, group=self._control)

    def close(self) -> None:
        """Ends the workers and this process's groups (another engine may start after)."""
        if not self._workers:
            return
        try:
            self._send([("exit",)])
            for w in self._workers:
                w.join(JOIN_TIMEOUT_S)
        finally:
            self._kill_workers()
            if dist.is_initialized():
                dist.destroy_process_group()

    def _kill_workers(self) -> None:
        for w in self._workers:
            if w.is_alive():
                w.kill()
                w.join()
        self._workers = []
