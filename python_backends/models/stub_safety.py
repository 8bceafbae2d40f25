"""Keeping the Python backend stub of server 2.51 alive: two places where it frees our objects on a
thread without a Python thread state, and how the adapters stay clear of them.

The stub of python_backend r24.10 destroys an output tensor (`PbTensor`, which owns numpy arrays)
without the GIL in two places. In Python 3.12, freeing a Python object on a thread without a thread
state dereferences NULL, so the stub dies with a segmentation fault inside libpython, and every
request in that model is lost. (Upstream fixed this in r24.12: the tensor's destructor takes the GIL.)

1. **Decoupled `response_sender.send()`** releases the GIL and then drops the output tensors the
   request did not ask for (`response_sender.cc`, `PruneOutputTensors`). This is deadly when such a
   tensor's last owner is the response, e.g. a tensor built inside the `send(...)` call. So the
   decoupled adapters (`moe_decoder`, `mm_qa_bls`) build only the outputs the request asked for:
   `requested_outputs`.
2. **A decoupled BLS call read to its end:** the stub queues a clean-up. Its own thread then erases
   the stub's reference to the response iterator, without the GIL (`pb_stub.cc`, `SendCleanupId`).
   If the model has already dropped its reference, that erase frees every response's tensors, off
   the GIL. `Keepalive` holds each finished iterator for a few seconds, so the last reference is
   always the model's and is dropped under the GIL. These are `mm_qa_bls`'s decoder streams. This
   is the likely cause of its stub's crash after about 300 requests of the H200 soak; that run has
   not been repeated since.

This module does not import Triton, so it can be tested without a server.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from typing import Callable

# Far beyond how long the stub's clean-up thread takes to reach a queued erase: each erase costs a
# map lookup and one message to the server, so a backlog of seconds would be a stalled server.
KEEP_S = 5.0


def requested_outputs(request) -> frozenset[str]:
    """The outputs a response to `request` may carry. A client that names no outputs gets them
    all: Triton fills the request's list with every output of the model."""
    return frozenset(request.requested_output_names())


class Keepalive:
    """Holds objects for `seconds` after `hold`, then drops them on the next `hold` call's thread.
    That thread is a Python thread, so it holds the GIL."""

    def __init__(self, seconds: float = KEEP_S, clock: Callable[[], float] = time.monotonic):
        self.seconds, self._clock = seconds, clock
        self._held: deque[tuple[float, object]] = deque()
        self._lock = threading.Lock()

    def hold(self, obj) -> None:
        now = self._clock()
        with self._lock:
            self._held.append((now + self.seconds, obj))
            expired = []
            while self._held and self._held[0][0] <= now:
                expired.append(self._held.popleft())
        del expired  # dropped here, outside the lock

    def __len__(self) -> int:
        return len(self._held)
