"""Sends moe_decoder's responses, and asks about cancellations, off the engine thread.

Each response a Triton Python model sends is a round trip to the server process: the stub's
`ResponseSender.send` waits until the server has taken the response (python_backend r24.10, the
stub in server 2.51), and `is_cancelled()` asks the server each time until it says yes. Made on the
engine thread, once per running request per step, those round trips were part of every decode
step: at 16 streams on a 2-core CPU test server they added 6.5 ms to a 37 ms step, and on the H200
the served TPOT at concurrency 16 was 3x the engine's step. Both calls release the GIL while they
wait, so threads can overlap them with each other and with the engine's next step.

The engine thread (`serving.decoder.DecoderService`) hands every response to `send` / `send_error`
and goes on; `threads` writer threads deliver them. A request's responses all go through one thread
(picked by its key), in the order they were handed over. The same threads poll their requests'
`is_cancelled` at most every `poll_s` and report a client that cancelled, or a send that failed (the
client is gone; logged, as a send may fail for a client still there), through `take_stopped()`,
which the engine thread reads before each step: it stops those sequences there, as it did when it
asked itself.
"""
from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from .decode_request import DecodeResponse, ResponseSink

CANCEL_POLL_S = 0.02  # a cancelled request stops within about this, plus a step
CANCELLED, GONE = "cancelled", "gone"  # why take_stopped() reports a key


@dataclass(frozen=True)
class _Watch:
    key: int
    sink: ResponseSink


@dataclass(frozen=True)
class _Response:
    key: int
    sink: ResponseSink
    response: DecodeResponse | None
    final: bool


@dataclass(frozen=True)
class _Error:
    key: int
    sink: ResponseSink
    message: str
    busy: bool


_STOP = object()


class _Writer:
    """One thread: delivers its queue in order, and polls the requests it watches for cancellation."""

    def __init__(self, name: str, poll_s: float, report, log: Callable[[str], None] | None):
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self._poll_s, self._report, self._log = poll_s, report, log
        self._watched: dict[int, ResponseSink] = {}  # touched by this thread only
        self._gone: set[int] = set()  # keys whose client went away: their later responses are dropped
        self._polled_at = 0.0
        self.thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self.thread.start()

    def _loop(self):
        while True:
            try:
                item = self.queue.get(timeout=self._poll_s)
            except queue.Empty:
                item = None
            if item is _STOP:
                return
            if item is not None:
                self.deliver(item)
            if time.monotonic() - self._polled_at >= self._poll_s:
                self._poll()

    def deliver(self, item):
        if isinstance(item, _Watch):
            self._watched[item.key] = item.sink
            return
        final = item.final if isinstance(item, _Response) else True
        if final:
            self._watched.pop(item.key, None)
        if item.key in self._gone:
            if final:
                self._gone.discard(item.key)
            return
        try:
            if isinstance(item, _Response):
                item.sink.send(item.response, item.final)
            else:
                item.sink.send_error(item.message, busy=item.busy)
        except Exception as e:  # the client went away: stop the request, drop what else comes for it
            self._watched.pop(item.key, None)
            if not final:
                self._gone.add(item.key)
            self._report(item.key, GONE)
            if self._log is not None:  # a send can fail for a client still there: its answer then ends short
                self._log(f"moe_decoder: a response could not be sent ({e!r}); the request is stopped")

    def _poll(self):
        self._polled_at = time.monotonic()
        for key, sink in list(self._watched.items()):
            try:
                cancelled = sink.is_cancelled()
            except Exception as e:  # the response sender is unusable: as good as gone
                cancelled = True
                if self._log is not None:  # said aloud: else the request ends unanswered and leaves no trace
                    self._log(f"moe_decoder: is_cancelled() failed ({e!r}); the request is stopped as cancelled")
            if cancelled:
                del self._watched[key]
                self._report(key, CANCELLED)


class ResponseWriter:
    """`threads` writer threads; keys are the requests' identities (the service's Pending.key). log:
    where an `is_cancelled()` that raised, or a send that failed, is reported (the request is then
    stopped as cancelled, or as gone)."""

    def __init__(self, threads: int = 4, poll_s: float = CANCEL_POLL_S, log: Callable[[str], None] | None = None):
        self._stopped: dict[int, str] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._writers = [_Writer(f"zipmoe-responses-{i}", poll_s, self._report, log) for i in range(threads)]

    def _put(self, key: int, item) -> None:
        writer = self._writers[key % len(self._writers)]
        if self._closed:  # after close() (a step that outlived shutdown): deliver here, nothing is lost
            writer.deliver(item)
        else:
            writer.queue.put(item)

    def _report(self, key: int, why: str) -> None:
        with self._lock:
            self._stopped.setdefault(key, why)

    def watch(self, key: int, sink: ResponseSink) -> None:
        """Polls the request's is_cancelled from now until its final response is delivered."""
        if not self._closed:
            self._put(key, _Watch(key, sink))

    def send(self, key: int, sink: ResponseSink, response: DecodeResponse | None, final: bool) -> None:
        self._put(key, _Response(key, sink, response, final))

    def send_error(self, key: int, sink: ResponseSink, message: str, busy: bool = False) -> None:
        """The request's final response: an error (busy: ServerBusy)."""
        self._put(key, _Error(key, sink, message, busy))

    def take_stopped(self) -> dict[int, str]:
        """Keys reported since the last call: CANCELLED (the client cancelled) or GONE (a send failed)."""
        with self._lock:
            stopped, self._stopped = self._stopped, {}
        return stopped

    def close(self, timeout: float = 10) -> None:
        """Delivers everything handed over so far, then stops the threads (waiting at most `timeout`
        for all of them); what is handed over later is delivered on the caller's thread."""
        if self._closed:
            return
        self._closed = True
        for writer in self._writers:
            writer.queue.put(_STOP)
        deadline = time.monotonic() + timeout
        for writer in self._writers:
            writer.thread.join(max(0.0, deadline - time.monotonic()))
