"""A CUDA error that breaks the process for good: telling it apart, and ending the process.

A device-side assert or an illegal memory access leaves the process's CUDA context broken: every
later CUDA call fails with the same error, so a model would refuse every request from then on while
Triton's health endpoints kept answering 200 (the Python backend of server 2.51 has no way to say
otherwise). Seen once: a bug in a new CUDA-graph path (session 23) left `moe_decoder` failing all
of 4,316 requests for the rest of a 40 s run. An error that passes (out of memory, a launch refused
for its arguments) leaves the context working. `device_lost` tells the two apart by asking the
device once more. A model whose device is lost answers what it holds with `lost_message`, then
ends its stub process (`end_process`): `zipmoe serve` (supervisor.py) sees the stub die and
restarts the whole server, whose health endpoints stop answering meanwhile; under a bare
tritonserver the model then fails each request at once ("Stub process ... is not healthy").
"""
from __future__ import annotations

import os
import threading
from typing import Callable

import torch

from .errors import INTERNAL_ERROR

EXIT_CODE = 70  # EX_SOFTWARE: the stub's exit status names why it ended
_exit = os._exit  # tests replace it


def device_lost(error: BaseException, device: torch.device | str) -> bool:
    """True when `error` came with a CUDA context that no longer works on `device`."""
    device = torch.device(device)
    if device.type != "cuda" or isinstance(error, torch.OutOfMemoryError):
        return False
    try:
        torch.cuda.synchronize(device)  # a broken context answers every call with its error
    except Exception:  # noqa: BLE001 -- whatever it raises, the device no longer works
        return True
    return False


def lost_message(where: str, error: BaseException) -> str:
    """The clients' message: an internal error (clients answer it with 500), and what happens next."""
    return (f"{where}: {INTERNAL_ERROR}: the GPU's CUDA context is lost ({error!r}); the model's process "
            "exits so that the server can be restarted")


def end_process(log: Callable[[str], None], message: str, delay_s: float = 0.0) -> None:
    """Logs `message` and ends this process with EXIT_CODE: at once, or after `delay_s` seconds on a
    timer thread (a model whose answers Triton delivers only after `execute` returns)."""
    log(message)
    if delay_s > 0:
        timer = threading.Timer(delay_s, _exit, (EXIT_CODE,))
        timer.daemon = True
        timer.start()
    else:
        _exit(EXIT_CODE)
