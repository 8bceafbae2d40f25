"""`moe_decoder`: decoupled Triton model around the continuous-batching engine.

`execute()` validates each request, hands it to the engine thread and returns at once. The
engine thread admits new requests between steps (so they join the running batch at the next
step), runs one step, and sends each sequence's response: one per token when streaming,
one at the end otherwise. A cancelled request is aborted, and its KV blocks freed, before the
next step.
"""
from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass

import numpy as np
import torch
import triton_python_backend_utils as pb_utils

from ..detokenize import TextStream, TokenBytes
from ..engine.engine import EngineConfig, LLMEngine, RequestError
from ..engine.multimodal import VisualInputs, splice_images
from ..engine.sequence import SamplingParams, Sequence
from .io import (BadInput, Metrics, device_and_dtype, error_response, get_input, model_parameters, resolve_checkpoint,
                 scalar, strings)

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
METRICS_PERIOD_S = 0.1


@dataclass(eq=False)
class Pending:
    prompt_ids: list[int]
    params: SamplingParams
    sender: object
    stream: bool
    text: TextStream
    arrival: float
    visual: VisualInputs | None
    tokens_kept: np.ndarray  # per image, echoed in every response
    opt_out: bool  # the client sent sere=false: this request keeps its top-K experts
    seq: Sequence | None = None  # set when the engine thread admits the request


def engine_config(params: dict[str, str]) -> EngineConfig:
    device, dtype = device_and_dtype(params)
    ints = {k: int(params[k]) for k in ("block_size", "num_kv_blocks", "max_num_seqs", "max_num_batched_tokens",
                                        "max_model_len", "max_tokens_cap", "sere_primary_k", "oea_k0", "truncate_k",
                                        "routing_min_batch") if params.get(k)}
    extra = {}
    for flag in ("sere_protect", "cuda_graphs"):
        if params.get(flag):
            if params[flag].lower() not in ("true", "false"):
                raise ValueError(f"{flag} must be true or false, got {params[flag]!r}")
            extra[flag] = params[flag].lower() == "true"
    if params.get("sere_threshold"):
        extra["sere_threshold"] = float(params["sere_threshold"])
    return EngineConfig(device=device, dtype=dtype, routing_policy=params.get("routing_policy", "topk"),
                        **ints, **extra)


class TritonPythonModel:
    def initialize(self, args):
        params = model_parameters(args)
        checkpoint = resolve_checkpoint(args, params)
        config = engine_config(params)
        self.engine = LLMEngine(checkpoint, config)
        pb_utils.Logger.log_info(f"moe_decoder: {checkpoint} on {config.device} ({config.dtype}), "
                                 f"{config.num_kv_blocks} KV blocks of {config.block_size} tokens")
        self.token_bytes = TokenBytes.from_tokenizer_json(checkpoint)
        self.default_max_tokens = int(params.get("default_max_tokens", "64"))
        self._inbox: queue.Queue[Pending] = queue.Queue()
        self._live: dict[int, Pending] = {}
        self._stop = threading.Event()
        self._metrics()
        self._thread = threading.Thread(target=self._loop, name="zipmoe-engine", daemon=True)
        self._thread.start()

    def _metrics(self):
        self._metric_families = Metrics(pb_utils, "moe_decoder")
        counter, gauge = self._metric_families.counter, self._metric_families.gauge

        self.m_requests = counter("zipmoe_requests_completed_total", "Requests that finished generating")
        self.m_ttft = counter("zipmoe_ttft_microseconds_total", "Sum of time to first token (arrival to first token)")
        self.m_decode_us = counter("zipmoe_decode_microseconds_total", "Sum of time from first to last token")
        self.m_decode_tokens = counter("zipmoe_decode_tokens_total", "Tokens generated after the first one")
        self.m_prompt_tokens = counter("zipmoe_prompt_tokens_total", "Prompt tokens prefilled")
        self.m_preemptions = counter("zipmoe_preemptions_total", "Sequences preempted for lack of KV blocks")
        self.m_cancelled = counter("zipmoe_requests_cancelled_total", "Requests stopped because the client cancelled")
        self.m_gauges = {
            "free": gauge("zipmoe_kv_blocks_free", "KV cache blocks not held by any sequence"),
            "total": gauge("zipmoe_kv_blocks_total", "KV cache blocks in all"),
            "running": gauge("zipmoe_running_requests", "Sequences in the decode batch"),
            "waiting": gauge("zipmoe_waiting_requests", "Sequences waiting for admission"),
        }
        self._metrics_sent_at = 0.0
        # Routing: sums over decode layer-steps (union_after / layer_steps = mean experts read per layer).
        self.m_routing = {
            "layer_steps": counter("zipmoe_moe_layer_steps_total", "MoE layer executions in decode steps"),
            "union_before": counter("zipmoe_moe_union_before_total", "Distinct experts the router chose, summed"),
            "union_after": counter("zipmoe_moe_union_after_total", "Distinct experts computed after re-routing, summed"),
            "rerouted_slots": counter("zipmoe_moe_rerouted_slots_total", "Token slots moved to another expert"),
        }

    def _update_gauges(self, force: bool = False):
        """Engine state to the metrics endpoint, at most every METRICS_PERIOD_S while the engine works
        (each change sent is a round trip to the server; the routing counters change every step)."""
        now = time.monotonic()
        if not force and self.engine.has_work and now - self._metrics_sent_at < METRICS_PERIOD_S:
            return
        self._metrics_sent_at = now
        sched = self.engine.scheduler
        values = {"free": self.engine.blocks.num_free, "total": self.engine.blocks.num_blocks,
                  "running": len(sched.running), "waiting": len(sched.waiting)}
        for k, v in values.items():
            self.m_gauges[k].sync(v)
        routing = self.engine.model.routing_stats.snapshot()
        for k, metric in self.m_routing.items():
            metric.sync(routing[k])
        self.m_preemptions.sync(sched.num_preemptions)

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            try:
                pending = self._parse(request, sender)
            except (BadInput, RequestError) as e:
                sender.send(error_response(pb_utils, str(e)), flags=FINAL)
                continue
            self._inbox.put(pending)
        return None

    def _parse(self, request, sender) -> Pending:
        ids = pb_utils.get_input_tensor_by_name(request, "input_ids").as_numpy().reshape(-1).tolist()
        seed = scalar(pb_utils, request, "random_seed", None, int)
        params = SamplingParams(
            max_tokens=scalar(pb_utils, request, "max_tokens", self.default_max_tokens, int),
            temperature=scalar(pb_utils, request, "temperature", 0.0, float),
            top_p=scalar(pb_utils, request, "top_p", 1.0, float),
            top_k=scalar(pb_utils, request, "top_k", 0, int),
            seed=seed,
            stop=tuple(s for s in strings(pb_utils, request, "stop_words") if s),
            ignore_eos=scalar(pb_utils, request, "ignore_eos", False, bool),
        )
        ids, visual, kept = self._splice(request, ids)
        self.engine.check_request(ids, params, visual)
        stream = scalar(pb_utils, request, "stream", False, bool)
        opt_out = not scalar(pb_utils, request, "sere", True, bool)
        return Pending(ids, params, sender, stream, TextStream(self.token_bytes, params.stop), time.monotonic(),
                       visual, kept, opt_out)

    def _splice(self, request, ids: list[int]) -> tuple[list[int], VisualInputs | None, np.ndarray]:
        """Expands each image placeholder to the tokens the vision encoder kept (none for text-only)."""
        kept = get_input(pb_utils, request, "visual_tokens_kept")
        kept = np.zeros(0, np.int32) if kept is None else kept.reshape(-1).astype(np.int32)
        if kept.size == 0:
            return ids, None, kept
        width, total = self.engine.text.hidden_size, int(kept.sum())
        arrays = {name: get_input(pb_utils, request, name)
                  for name in ("visual_embeds", "deepstack_embeds", "visual_positions", "image_grids")}
        # Everything must describe the same kept tokens: a request that does not is refused here, not
        # in the middle of a batched step (where it would fail the other requests).
        shapes = {"visual_embeds": (total, width), "visual_positions": (total, 2), "image_grids": (kept.size, 2)}
        for name, shape in shapes.items():
            if arrays[name] is None or arrays[name].shape != shape:
                got = None if arrays[name] is None else list(arrays[name].shape)
                raise BadInput(f"{name} must have shape {list(shape)} for visual_tokens_kept {kept.tolist()}, got {got}")
        deepstack = arrays["deepstack_embeds"]
        if deepstack is None or deepstack.ndim != 3 or deepstack.shape[1:] != (total, width):
            raise BadInput(f"deepstack_embeds must have shape [layers, {total}, {width}]")
        grids = [tuple(g) for g in arrays["image_grids"].tolist()]
        try:
            ids, pos, delta = splice_images(ids, self.engine.text.image_token_id, kept.tolist(),
                                            torch.from_numpy(arrays["visual_positions"]), grids)
        except ValueError as e:
            raise BadInput(str(e)) from None
        visual = VisualInputs(torch.from_numpy(arrays["visual_embeds"]), torch.from_numpy(deepstack), pos, delta)
        return ids, visual, kept

    # --- engine thread -------------------------------------------------------------------------

    def _loop(self):
        while not self._stop.is_set():
            try:
                self._iterate()
            except Exception as e:  # a bug must not hang clients or kill the thread: fail what is in flight
                pb_utils.Logger.log_error(f"moe_decoder engine step failed: {e!r}")
                for p in list(self._live.values()):
                    self._fail(p, f"engine step failed: {e!r}")

    def _iterate(self):
        self._admit(block=not self.engine.has_work)
        self._drop_cancelled()
        results = self.engine.step() if self.engine.has_work else []
        # Publish before answering when a request ends: a client that has its last response then
        # finds its work in the metrics.
        self._update_gauges(force=any(seq.finished for seq, _ in results))
        for seq, token in results:
            pending = self._live.get(seq.seq_id)
            if pending is not None:
                self._respond(pending, token)

    def _admit(self, block: bool):
        try:
            item = self._inbox.get(timeout=0.1) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            p = item
            try:
                p.seq = self.engine.add_request(p.prompt_ids, p.params, opt_out=p.opt_out, visual=p.visual)
            except Exception as e:  # checked in execute() already; never let one request fail the others
                p.sender.send(error_response(pb_utils, str(e)), flags=FINAL)
            else:
                p.seq.arrival = p.arrival  # time to first token counts from execute()
                self._live[p.seq.seq_id] = p
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _drop_cancelled(self):
        for p in list(self._live.values()):
            if p.sender.is_cancelled():
                self.engine.abort(p.seq)
                del self._live[p.seq.seq_id]
                self.m_cancelled.increment(1)
                self._send(p, None, FINAL)

    def _respond(self, p: Pending, token: int):
        seq = p.seq
        if p.text.push(token) and not seq.finished:
            self.engine.finish_stopped(seq)
        if not (p.stream or seq.finished):
            return
        first, begin, end = p.text.release(final=seq.finished)
        window = np.asarray(seq.output_ids[first:], dtype=np.int32)
        out = [
            pb_utils.Tensor("output_ids", window),
            pb_utils.Tensor("text_range", np.asarray([begin, end], dtype=np.int32)),
            pb_utils.Tensor("input_token_count", np.asarray([len(seq.prompt_ids)], dtype=np.int32)),
            pb_utils.Tensor("output_token_count", np.asarray([len(seq.output_ids)], dtype=np.int32)),
            pb_utils.Tensor("finish_reason", np.asarray([(seq.finish_reason or "").encode()], dtype=np.object_)),
            pb_utils.Tensor("visual_tokens_kept", p.tokens_kept),
        ]
        if seq.finished:
            del self._live[seq.seq_id]
            self._record(seq)
        self._send(p, pb_utils.InferenceResponse(output_tensors=out), FINAL if seq.finished else 0)

    def _record(self, seq: Sequence):
        now = time.monotonic()
        self.m_requests.increment(1)
        self.m_prompt_tokens.increment(len(seq.prompt_ids))
        self.m_ttft.increment(int((seq.first_token_time - seq.arrival) * 1e6))
        self.m_decode_us.increment(int((now - seq.first_token_time) * 1e6))
        self.m_decode_tokens.increment(len(seq.output_ids) - 1)

    def _fail(self, p: Pending, message: str):
        self.engine.abort(p.seq)
        self._live.pop(p.seq.seq_id, None)
        self._send(p, error_response(pb_utils, message), FINAL)

    def _send(self, p: Pending, response, flags: int):
        try:
            p.sender.send(response, flags=flags)
        except Exception:  # the client went away between the check and the send
            if not p.seq.finished:
                self.engine.abort(p.seq)
                self._live.pop(p.seq.seq_id, None)

    def finalize(self):
        self._stop.set()
        self._thread.join(timeout=10)
        # Whoever still waits (live or not yet admitted) gets its final response: a request left
        # open keeps the server's shutdown waiting for it.
        pending = list(self._live.values())
        while not self._inbox.empty():
            pending.append(self._inbox.get_nowait())
        for p in pending:
            try:
                p.sender.send(error_response(pb_utils, "the server is shutting down"), flags=FINAL)
            except Exception:  # the client is gone already
                pass
        self._live.clear()
