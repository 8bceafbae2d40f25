"""moe_decoder's service, without Triton: typed requests in, streamed token windows out.

`models/moe_decoder.py` turns each Triton request into a `DecodeRequest` and a `ResponseSink`
(its response sender) and calls `submit()`, which splices the kept visual tokens into the prompt,
checks the request against the engine's limits and queues it — a bad request is refused there,
never in the middle of a batched step. So is overload (`ServerBusy`): at most `max_waiting_requests`
wait for admission, each holding its visual tokens in this model's memory, and one not admitted
within `max_queue_delay_ms` is answered busy (it has produced nothing yet). The engine thread
admits queued requests between steps (so they join the running batch at the next step), drops
cancelled ones (their KV blocks freed before the next step), runs one step, and hands each
sequence's answer to the `ResponseWriter`, whose threads send it through the request's sink while
the next step runs: one `DecodeResponse` per token when streaming, one at the end otherwise. Each response carries a window of token ids and the byte range of it that is new text
(`detokenize.TextStream`), which postprocess turns into a UTF-8-safe text delta. Once per metrics
period the engine thread also samples the load (`serving.load`) and hands the degradation level to
`on_level` when it changes (the adapter shares it with the models that choose the keep ratio).
"""
from __future__ import annotations

import itertools
import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

from ..detokenize import TextStream, TokenBytes
from ..engine.engine import LLMEngine
from ..engine.multimodal import VisualInputs
from ..engine.sequence import SamplingParams, Sequence, Status
from ..settings import make_current, setting
from .decode_request import DecodeRequest, DecodeResponse, ResponseSink, sampling_params, splice
from .decoder_metrics import finished_request, service_stats
from .device_loss import device_lost, end_process, lost_message
from .errors import SHUTTING_DOWN, internal_error, server_busy
from .gc_pauses import GcPauses
from .gpu_turn import TurnWaiter
from .load import DegradationConfig, DegradationController, Load, RecentTTFT
from .response_writer import CANCELLED, ResponseWriter

METRICS_PERIOD_S = 0.1


@dataclass(frozen=True)
class DecoderConfig:
    """moe_decoder's own settings (the engine's are `EngineConfig`)."""
    default_max_tokens: int = setting(64, "max_tokens of a request that sets none", min=1)
    max_waiting_requests: int = setting(256, "requests submitted and not yet admitted to the engine; more are "
                                             "refused busy (0: no bound)", min=0)
    max_queue_delay_ms: int = setting(0, "a request not admitted after this long is refused busy (0: off)", min=0)
    response_threads: int = setting(4, "threads that send the responses (and poll for cancellations) while the "
                                       "engine runs its next step", min=1)


@dataclass(frozen=True)
class Cancel:
    """cancel(tag), queued behind the requests submitted before it, so it finds them admitted."""
    tag: str


@dataclass(eq=False)
class Pending:
    prompt_ids: list[int]
    params: SamplingParams
    sink: ResponseSink
    stream: bool
    text: TextStream
    arrival: float
    visual: VisualInputs | None
    tokens_kept: np.ndarray
    tokens_before: int  # the images' merged visual tokens before VisionZip
    opt_out: bool  # the client sent sere=false: this request keeps its top-K experts
    key: int  # the request's identity for the ResponseWriter
    tag: str = ""
    keep_ratio: float = 1.0
    seq: Sequence | None = None  # set when the engine thread admits the request


class DecoderService:
    def __init__(self, engine: LLMEngine, token_bytes: TokenBytes, config: DecoderConfig = DecoderConfig(),
                 publish: Callable[[dict[str, float]], None] | None = None, log_error: Callable[[str], None] = print,
                 observe: Callable[[str, float], None] | None = None,
                 degradation: DegradationConfig = DegradationConfig(),
                 on_level: Callable[[int, str], None] | None = None, gpu_turn: TurnWaiter | None = None):
        """publish(stats()) is called from the engine thread, at most every METRICS_PERIOD_S while
        it works and whenever a request ends; observe(decoder_metrics.HISTOGRAMS name, value) once
        per finished request and histogram; on_level(level, why) at each change of the degradation
        level (never with ttft_target_ms 0); gpu_turn: before each step, wait while vision_encoder
        holds this GPU (`gpu_turn`)."""
        self.engine = engine
        self.token_bytes = token_bytes
        self.config = config
        self._publish, self._log_error, self._observe = publish, log_error, observe
        self._inbox: queue.Queue[Pending | Cancel] = queue.Queue()
        self._live: dict[int, Pending] = {}
        self._unadmitted: dict[int, Pending] = {}  # live requests the scheduler has not admitted yet
        # Requests submitted and not yet admitted (in the inbox or _unadmitted), what max_waiting_requests
        # bounds: submit() counts on Triton's thread, the engine thread discounts, so under a lock.
        self._waiting, self._waiting_lock = 0, threading.Lock()
        self._cancel_tags: set[str] = set()  # tags of live requests that cancel() stops before the next step
        self._stop = threading.Event()
        self._losing = threading.Lock()  # held by the thread that ends the process (lose_device)
        self._published_at = 0.0
        self._controller = (DegradationController(degradation.ttft_target_ms, engine.config.max_num_seqs)
                            if degradation.ttft_target_ms else None)
        self._on_level, self._ttfts, self._sampled_at = on_level, RecentTTFT(), 0.0
        self._gpu_turn = gpu_turn
        self.counts = dict.fromkeys(("requests_completed", "requests_cancelled", "requests_rejected_busy", "ttft_us",
                                     "decode_us", "decode_tokens", "prompt_tokens", "visual_tokens",
                                     "visual_tokens_kept", "gpu_turn_waits", "gpu_turn_wait_us"), 0)
        self._keys = itertools.count()
        self._arrivals = 0  # requests queued so far
        self._writer = ResponseWriter(config.response_threads, log=log_error)
        self._gc = GcPauses()  # every collection stalls the engine loop: counted for the metrics
        self._thread = threading.Thread(target=self._loop, name="zipmoe-engine", daemon=True)
        self._thread.start()

    # --- any thread ----------------------------------------------------------------------------

    def submit(self, request: DecodeRequest, sink: ResponseSink) -> None:
        """Checks and queues a request; a bad one raises BadInput or engine.RequestError, and one beyond
        max_waiting_requests ServerBusy (nothing queued); after lose_device, RuntimeError."""
        if self._losing.locked():
            raise RuntimeError("moe_decoder: the GPU's CUDA context is lost; the model's process is ending")
        params = sampling_params(request.options, self.config.default_max_tokens)
        ids, visual, kept, before = splice(request, self.engine.text)
        self.engine.check_request(ids, params, visual)
        self._join_waiting()  # after the checks: a request refused busy is one worth retrying as it is
        opt_out = not request.options.get("sere", True)
        self._inbox.put(Pending(ids, params, sink, bool(request.options.get("stream", False)),
                                TextStream(self.token_bytes, params.stop), time.monotonic(), visual, kept, before,
                                opt_out, next(self._keys), request.tag, request.keep_ratio))
        self._arrivals += 1  # after the put: a wait this ends finds the request queued (_wait_for_turn)

    def _join_waiting(self) -> None:
        limit = self.config.max_waiting_requests
        with self._waiting_lock:
            if limit and self._waiting >= limit:
                self.counts["requests_rejected_busy"] += 1
                raise server_busy(f"{self._waiting} requests waiting in moe_decoder (max_waiting_requests {limit})")
            self._waiting += 1

    def _leave_waiting(self) -> None:
        with self._waiting_lock:
            self._waiting -= 1

    def cancel(self, tag: str) -> None:
        """Stops the request submitted with `tag` before its next step, as if its client had cancelled
        (a tag of a request already finished, or never seen, is ignored)."""
        self._inbox.put(Cancel(tag))

    def stats(self, wait: bool = True) -> dict[str, float]:
        """Counters (only grow) and gauges of the service, the engine's KV cache, its routing and the load.
        wait False: the routing sums as of the last step whose tokens were read back, so exact for every
        token sent without waiting for a step in flight (`RoutingStats.snapshot`)."""
        return service_stats(self.counts, self.engine, self._controller, self._gc.stats(), wait)

    def shutdown(self, message: str = SHUTTING_DOWN) -> None:
        """Stops the engine thread; whoever still waits (admitted or not) gets `message` as its final
        error: a request left open keeps the server's shutdown waiting for it."""
        self._stop.set()
        self._thread.join(timeout=10)
        self._fail_everyone(message)
        self._gc.close()
        if self._gpu_turn is not None:
            self._gpu_turn.close()

    def lose_device(self, error: BaseException) -> None:
        """Any thread, once: the CUDA context is lost (device_loss.py); whoever waits gets the error, the process ends."""
        if self._losing.acquire(blocking=False):  # else another thread is ending the process
            self._stop.set()  # and submit() refuses from now on
            self._fail_everyone(message := lost_message("moe_decoder", error))
            self._fail_everyone(message)  # whoever got past submit()'s check meanwhile
            end_process(self._log_error, message)

    def _fail_everyone(self, message: str) -> None:
        queued = []
        while not self._inbox.empty():
            queued.append(self._inbox.get_nowait())
        for p in [*self._live.values(), *(q for q in queued if isinstance(q, Pending))]:
            self._send_error(p, message)
        self._live.clear()
        self._writer.close()  # after everything above is delivered

    # --- engine thread -------------------------------------------------------------------------

    def _loop(self):
        make_current(self.engine.device)  # a new thread starts on GPU 0; the engine's kernels run on its own
        while not self._stop.is_set():
            try:
                self._iterate()
            except Exception as e:  # a bug must not hang clients or kill the thread: fail what is in flight
                if device_lost(e, self.engine.device):  # every later step would fail the same way
                    return self.lose_device(e)
                self._log_error(f"moe_decoder engine step failed: {e!r}")
                for p in list(self._live.values()):
                    self._fail(p, internal_error("moe_decoder engine step", e))

    def _iterate(self):
        # vision_encoder starts its turn when the decoder shows no step on the GPU (`gpu_turn`).
        turn, idle = self._gpu_turn, not self.engine.has_work
        if turn is not None and not idle:
            self._wait_for_turn()  # first: a request that ends the wait is admitted into the step that follows
        if turn is not None:
            turn.busy(self.engine.has_work)  # (the read-back may have ended the last sequence)
        self._admit(block=not self.engine.has_work)
        if turn is not None and idle and self.engine.has_work:  # work came to an idle decoder
            self._wait_for_turn(working=True)  # not beside a tower at work; its own request goes at once
        self._drop_cancelled()
        self._drop_overdue()
        results = self.engine.step() if self.engine.has_work else []
        self._note_admitted()
        self._sample_load()
        self._emit(results)

    def _emit(self, results: list[tuple[Sequence, int]]) -> None:
        """Hands a step's tokens to their requests' sinks (through the ResponseWriter)."""
        replies = []
        for seq, token in results:
            p = self._live.get(seq.seq_id)
            reply = None if p is None else self._reply(p, token)
            if reply is not None:
                replies.append(reply)
        # The tokens of requests going on leave first: nothing below may hold them back. A request that
        # ends is counted and published before its last response (whose client then finds it in the metrics).
        ends = [(p, response) for p, response, final in replies if final]
        try:
            for p, response, final in replies:
                if not final:
                    self._send(p, response, False)
            for p, _ in ends:
                self._record(p)
            self._maybe_publish(force=bool(ends))
        finally:  # out of the live set already: nothing else would ever answer them
            for p, response in ends:
                self._send(p, response, True)

    def _wait_for_turn(self, working: bool = False) -> None:
        """Holds the next step back while vision_encoder has this GPU (`gpu_turn`: never two steps in
        a row), until a request arrives after its release (its own: the step that follows admits it),
        or the service stops (working: only while the tower still works, TurnWaiter.held). `_arrivals`
        counts the requests queued (any thread: a lost count costs at most the hand-off's 10 ms).
        The step in flight (async scheduling) finishes during the turn: its tokens go out first."""
        self._gpu_turn.busy(True)  # the engine has work
        if self._gpu_turn.held(working):
            self._drop_cancelled()  # first, as before a step: a stopped request gets no more tokens
            self._emit(self.engine.read_back())
            if not self.engine.has_work:  # those were the last tokens: nothing to hold back
                return
        waited = self._gpu_turn.wait(arrivals=lambda: self._arrivals, stopping=self._stop.is_set)
        if waited:
            self.counts["gpu_turn_waits"] += 1
            self.counts["gpu_turn_wait_us"] += int(waited * 1e6)

    def _maybe_publish(self, force: bool) -> None:
        now = time.monotonic()
        if self._publish is None or (not force and self.engine.has_work and now - self._published_at < METRICS_PERIOD_S):
            return
        self._published_at = now
        try:  # exact without waiting: the routing sums came back with the last tokens read (engine.py)
            self._publish(self.stats(wait=not self.engine.step_in_flight))
        except Exception as e:  # the metrics must never cost a client its answer
            self._log_error(f"moe_decoder metrics: {e!r}")

    def _sample_load(self) -> None:
        """Once per metrics period (the loop turns at least every 0.1 s, idle or not): the load, and
        the level from it."""
        now = time.monotonic()
        if self._controller is None or now - self._sampled_at < METRICS_PERIOD_S:
            return
        self._sampled_at = now
        blocks = self.engine.blocks
        no_token_yet = [p.arrival for p in self._live.values() if p.seq.first_token_time is None]
        load = Load(self._waiting, 1 - blocks.num_free / blocks.num_blocks,
                    max(self._ttfts.p90(now), now - min(no_token_yet, default=now)))
        before = self._controller.level
        level = self._controller.update(now, load)
        if level != before and self._on_level is not None:
            self._on_level(level, self._controller.explain(load))

    def _admit(self, block: bool):
        try:
            item = self._inbox.get(timeout=0.1) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            if isinstance(item, Cancel):
                if item.tag and any(live.tag == item.tag for live in self._live.values()):
                    self._cancel_tags.add(item.tag)
            else:
                self._add(item)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _add(self, p: Pending) -> None:
        try:
            p.seq = self.engine.add_request(p.prompt_ids, p.params, opt_out=p.opt_out, visual=p.visual)
        except Exception as e:  # checked in submit() already; never let one request fail the others
            self._leave_waiting()
            self._send_error(p, str(e))
        else:
            p.seq.arrival = p.arrival  # time to first token counts from submit()
            self._live[p.seq.seq_id] = p
            self._unadmitted[p.seq.seq_id] = p
            self._writer.watch(p.key, p.sink)

    def _note_admitted(self) -> None:
        """Discounts the requests the step admitted. A preempted sequence waits again but is not counted:
        it holds what it holds already, and at most max_num_seqs are preempted."""
        for seq_id, p in list(self._unadmitted.items()):
            if p.seq.status is not Status.WAITING:
                del self._unadmitted[seq_id]
                self._leave_waiting()

    def _forget(self, p: Pending) -> None:
        """Takes a request out of the live set, and out of the waiting count if it was never admitted."""
        self._live.pop(p.seq.seq_id, None)
        if self._unadmitted.pop(p.seq.seq_id, None) is not None:
            self._leave_waiting()

    def _drop_overdue(self) -> None:
        """Refuses busy whoever has waited max_queue_delay_ms without being admitted (so it produced nothing)."""
        delay_ms = self.config.max_queue_delay_ms
        if not delay_ms:
            return
        now = time.monotonic()
        for p in [p for p in self._unadmitted.values() if (now - p.arrival) * 1000 > delay_ms]:
            self.engine.abort(p.seq)
            self._forget(p)
            with self._waiting_lock:
                self.counts["requests_rejected_busy"] += 1
            busy = server_busy(f"not admitted within max_queue_delay_ms {delay_ms} in moe_decoder")
            self._send_error(p, str(busy), busy=True)

    def _drop_cancelled(self):
        """Stops the requests whose client cancelled, that a cancel(tag) named, or whose client went away
        (a send failed): the writer threads report the first and the last."""
        stopped = self._writer.take_stopped()
        if not stopped and not self._cancel_tags:  # the usual step: nothing to look for
            return
        for p in list(self._live.values()):
            why = stopped.get(p.key)
            if why is None and p.tag not in self._cancel_tags:
                continue
            self._cancel_tags.discard(p.tag)
            self.engine.abort(p.seq)
            self._forget(p)
            if why is None or why == CANCELLED:
                self.counts["requests_cancelled"] += 1
            self._send(p, None, final=True)  # for a client gone, the writer drops it

    def _reply(self, p: Pending, token: int) -> tuple[Pending, DecodeResponse, bool] | None:
        """The response a new token calls for (None when not streaming and not finished); a finished
        request leaves the live set (`_emit` counts it)."""
        seq = p.seq
        if len(seq.output_ids) == 1:
            self._ttfts.add(seq.first_token_time, seq.first_token_time - seq.arrival)
        if p.text.push(token) and not seq.finished:
            self.engine.finish_stopped(seq)
        if not (p.stream or seq.finished):
            return None
        first, begin, end = p.text.release(final=seq.finished)
        response = DecodeResponse(np.asarray(seq.output_ids[first:], dtype=np.int32), (begin, end),
                                  len(seq.prompt_ids), len(seq.output_ids), seq.finish_reason or "", p.tokens_kept,
                                  p.keep_ratio)
        if seq.finished:
            self._forget(p)
        return p, response, seq.finished

    def _record(self, p: Pending):
        counts, observed = finished_request(p, time.monotonic())
        for name, n in counts.items():
            self.counts[name] += n
        if self._observe is None:
            return
        try:  # the request is out of the live set already: a failure here must not lose its final response
            for name, value in observed.items():
                self._observe(name, value)
        except Exception as e:
            self._log_error(f"moe_decoder metrics: {e!r}")

    def _fail(self, p: Pending, message: str):
        self.engine.abort(p.seq)
        self._forget(p)
        self._send_error(p, message)

    def _send_error(self, p: Pending, message: str, busy: bool = False):
        self._writer.send_error(p.key, p.sink, message, busy)

    def _send(self, p: Pending, response: DecodeResponse | None, final: bool):
        self._writer.send(p.key, p.sink, response, final)
