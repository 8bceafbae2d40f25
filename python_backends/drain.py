"""Draining tritonserver before it stops: the requests in flight finish, new ones are refused.

Why. At SIGINT, server 2.51 stops taking requests, the inner ones of requests in flight included:
each token an mm_qa stream generates goes through postprocess as a new request of the ensemble,
and mm_qa_bls calls postprocess by BLS. So a SIGINT cut every stream off at its next token, and
the server then waited its exit timeout (30 s) for them (measured on the CPU: an mm_qa stream
hung 35 s and ended in a gRPC error; an mm_qa_bls stream ended in "Server not ready").

How. `serve.TritonServer` runs the server with explicit model control, and its `stop()` calls
`drain()` first, which unloads the entry models (`ENTRY_MODELS`). Their new requests are refused at
once (Triton: "... has no available versions"; the OpenAI frontend answers 503) while those in
flight go on through the composing models, which stay loaded. An entry's unload completes when its
last request has finished (the ensemble) or its `finalize` has returned (mm_qa_bls waits there
for its worker threads). The drain ends when every entry is unloaded and moe_decoder holds no
sequence (its requests from other clients finish too), and the SIGINT then finds nothing in flight.

Server 2.51 does not always complete an unload: after a gRPC stream request failed the server's own
input checks (a wrong datatype, an unknown input name: measured every time), and at times when new
requests were refused during the drain (2 of 3 runs of one outside test), a request keeps a reference
to the model, and at exit the server waits its exit timeout for a "live model". So the drain also
ends when moe_decoder has held no sequence for `quiet_s` while an entry is still unloading: long
enough for a request in its vision stage to reach the decoder.
"""
from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from typing import Callable

from .clients.triton_client import scrape_metrics

ENTRY_MODELS = ("mm_qa", "mm_qa_bls")  # the models clients call; the others serve them
ADMIN_HEADER = "zipmoe-admin-key"  # the header serve.TritonServer restricts the repository API to
# The decoder's gauges of sequences admitted and waiting (serving/decoder_metrics.py).
DECODER_GAUGES = ("zipmoe_running_requests", "zipmoe_waiting_requests")
DRAIN_TIMEOUT_S = 25.0  # then SIGINT, and the server's exit timeout (serve.EXIT_TIMEOUT_S): within a minute
QUIET_S = 5.0
POLL_S = 0.2


def _post(url_http: str, path: str, headers: dict[str, str]) -> bytes:
    req = urllib.request.Request(f"http://{url_http}{path}", data=b"{}", method="POST", headers=headers)
    with urllib.request.urlopen(req, timeout=10) as r:
        return r.read()


def repository_index(url_http: str, headers: dict[str, str]) -> list[dict]:
    """Triton's repository index: each model's name, version, state (READY, UNLOADING, ...) and reason."""
    return json.loads(_post(url_http, "/v2/repository/index", headers))


def entry_states(url_http: str, headers: dict[str, str]) -> dict[str, str]:
    """State of each entry model the repository holds."""
    return {m["name"]: m.get("state", "") for m in repository_index(url_http, headers) if m["name"] in ENTRY_MODELS}


def decoder_sequences(url_metrics: str) -> float:
    """Sequences moe_decoder holds (running and waiting, all instances); 0 without a decoder or metrics."""
    try:
        metrics = scrape_metrics(url_metrics)
    except (urllib.error.URLError, OSError):
        return 0.0
    return sum(metrics.get(name, 0.0) for name in DECODER_GAUGES)


def drain(url_http: str, url_metrics: str, headers: dict[str, str], timeout: float = DRAIN_TIMEOUT_S,
          quiet_s: float = QUIET_S, running: Callable[[], bool] = lambda: True,
          log: Callable[[str], None] = print) -> str:
    """Unloads the entry models and waits as the module docstring says (`headers`: the server's admin
    key, which its repository API wants). Returns how it ended: "drained", "quiet" (an entry still
    unloading, the decoder idle for quiet_s), "timeout", or "stopped" (`running()` turned false: the
    server exited, or was told to stop now)."""
    try:
        entries = [name for name, state in entry_states(url_http, headers).items() if state == "READY"]
        for name in entries:
            _post(url_http, f"/v2/repository/models/{name}/unload", headers)
    except (urllib.error.URLError, OSError, ValueError) as e:
        log(f"zipmoe: cannot drain ({e}); stopping at once")
        return "stopped"
    start = idle_since = time.monotonic()
    while running():
        busy = decoder_sequences(url_metrics)
        now = time.monotonic()
        if busy:
            idle_since = now
        try:
            unloading = [n for n, state in entry_states(url_http, headers).items()
                         if n in entries and state == "UNLOADING"]
        except (urllib.error.URLError, OSError, ValueError):
            return "stopped"
        if not busy and not unloading:
            return "drained"
        if not busy and now - idle_since >= quiet_s:
            log(f"zipmoe: {', '.join(unloading)} still unloading with nothing in flight (server 2.51 keeps a "
                "model that some refused requests named); stopping")
            return "quiet"
        if now - start >= timeout:
            log(f"zipmoe: drain timed out after {timeout:.0f} s ({busy:.0f} sequences in moe_decoder); stopping")
            return "timeout"
        time.sleep(POLL_S)
    return "stopped"
