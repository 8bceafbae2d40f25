"""Doorbells: moe_decoder says "a response for request T is in your iterator" to a BLS caller, so the
caller never waits inside the stub's response iterator.

Why. The Python backend stub of server 2.51 (python_backend r24.10, unchanged upstream since) can
deadlock a model that reads decoupled BLS streams from several threads. Three locks, taken in a cycle:
- a reader thread waiting in `ResponseIterator.__next__` is woken by a response: it wakes up holding
  the iterator's mutex and then waits for the GIL (pb_response_iterator.cc, `Next`);
- the stub's delivery thread, bringing that iterator its next response, holds the stub's iterator
  map mutex and waits for the iterator's mutex (pb_stub.cc, `ProcessBLSResponseDecoupled`);
- a thread starting another decoupled BLS call holds the GIL and waits for the map mutex
  (`GetResponseIterator`, called with the GIL held once `exec(decoupled=True)` returns).
Every BLS response and send of the model then stops for good. Seen under load on the CPU (gdb and
py-spy stacks of `mm_qa_bls`'s stub, 2026-12-02): about one soak run in three of 300 streams at
concurrency 48, and a hung CI run.

A reader that calls `__next__` only when a response is already buffered never waits there, so it
never holds the iterator's mutex while waiting for the GIL, and the cycle cannot close. moe_decoder
hands each response over before its `send()` returns (the BLS caller's stub has it buffered by then:
the server delivers a BLS response inside the sender's call), then rings the bell: the request's tag
and a newline on a UNIX stream socket the caller listens on (a stream, not datagrams: Linux queues
only 10 datagrams per socket by default, and a burst of tokens would block the decoder's writers).
The caller waits on the bell of its stream, which releases the GIL, and reads one response per ring.

`Doorbells` is the caller's side (one listening socket per process, one reading thread per
connected decoder process); `Ring` the decoder's (one per request, one connection per caller
socket shared by all of them). Nothing here imports Triton.
"""
from __future__ import annotations

import os
import socket
import tempfile
import threading
import uuid

# A lost ring (the caller gone, or its socket unreadable) must not stall a stream for good: past this the
# reader reads anyway, and may then wait inside the iterator as it did before doorbells.
RING_TIMEOUT_S = 5.0
_SEND_TIMEOUT_S = 1.0  # the caller reads continuously; a full socket buffer drains in microseconds


class Doorbells:
    """The BLS caller's side: a listening socket of its own and a thread per connected decoder process,
    counting each tag's rings."""

    def __init__(self, directory: str | None = None):
        self.path = os.path.join(directory or tempfile.gettempdir(), f"zipmoe-bell-{uuid.uuid4().hex[:16]}.sock")
        self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._socket.bind(self.path)
        self._socket.listen(16)
        self._bells: dict[bytes, threading.Semaphore] = {}
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, name="zipmoe-doorbells", daemon=True).start()

    def open(self, tag: str) -> threading.Semaphore:
        """The bell of the stream tagged `tag`: one release per response moe_decoder handed over."""
        bell = threading.Semaphore(0)
        with self._lock:
            self._bells[tag.encode()] = bell
        return bell

    def discard(self, tag: str) -> None:
        with self._lock:
            self._bells.pop(tag.encode(), None)

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._socket.accept()
            except OSError:  # closed
                return
            threading.Thread(target=self._read, args=(conn,), name="zipmoe-doorbell", daemon=True).start()

    def _read(self, conn: socket.socket) -> None:
        pending = b""
        with conn:
            while chunk := conn.recv(65536):  # many rings per read under load: one GIL turn for all
                *tags, pending = (pending + chunk).split(b"\n")
                with self._lock:
                    bells = [self._bells.get(tag) for tag in tags]
                for bell in bells:
                    if bell is not None:  # a stream already read to its end (or never opened) ignores its rings
                        bell.release()

    def close(self) -> None:
        try:
            self._socket.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._socket.close()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


def wait(bell: threading.Semaphore | None, timeout: float = RING_TIMEOUT_S) -> bool:
    """Until the stream's next response is buffered (True), or `timeout` passed (False). No bell: True."""
    return True if bell is None else bell.acquire(timeout=timeout)


class Ring:
    """The decoder's side for one request: ring() after each response handed over. All requests of a
    process that ring one caller share one connection to it."""
    _connections: dict[str, socket.socket] = {}
    _lock = threading.Lock()

    def __init__(self, path: str, tag: str):
        self.path, self.message = path, tag.encode() + b"\n"

    def ring(self) -> None:
        """Best effort: a caller that went away loses the ring (and it reads after RING_TIMEOUT_S)."""
        with Ring._lock:  # one writer at a time per connection: the messages must not interleave
            for _ in range(2):  # a connection the caller closed is replaced once
                conn = Ring._connections.get(self.path)
                try:
                    if conn is None:
                        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                        conn.settimeout(_SEND_TIMEOUT_S)
                        conn.connect(self.path)
                        Ring._connections[self.path] = conn
                    conn.sendall(self.message)
                    return
                except OSError:
                    Ring._connections.pop(self.path, None)
                    if conn is not None:
                        conn.close()
