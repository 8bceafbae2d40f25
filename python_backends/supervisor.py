"""Keeps `zipmoe serve` answering when a model's Python stub process dies.

Server 2.51 does not recover from a Python-backend stub that dies under it (killed, or out of host
memory): the requests in flight on that model get nothing more, no error and no end; the health
endpoints keep answering 200; every later request fails at once with "Stub process ... is not
healthy"; and shutdown waits out its exit timeout. So `zipmoe serve` watches the stubs itself. When
one dies it kills the whole server at once — every request in flight then ends with an error on its
connection within a second, and the health endpoints stop answering (a load balancer or Kubernetes
routes around it) — and starts a new server on the same ports, which is ready again after its
models load. tritonserver itself exiting when no signal asked it to is handled the same way: a
stub killed while it held one of the Python backend's shared-memory locks can make the server
abort (boost::interprocess::lock_exception, seen in CI) before a poll sees the stub gone. More than
MAX_RESTARTS within RESTART_WINDOW_S gives up (exit 1): something is wrong that a restart does not
fix, and a supervisor above (Kubernetes) should see the process fail.
"""
from __future__ import annotations

import os
import time
from collections import deque
from pathlib import Path

STUB = b"triton_python_backend_stub"
POLL_S = 0.5
MAX_RESTARTS = 5
RESTART_WINDOW_S = 600.0


def stub_pids(group: int) -> dict[int, str]:
    """pid -> model instance name (e.g. moe_decoder_0_0) of the Python-backend stubs of the server
    whose process group is `group` (from /proc; the stub's 9th argument is the instance's name)."""
    stubs = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            if argv and argv[0].endswith(STUB) and os.getpgid(int(entry.name)) == group:
                stubs[int(entry.name)] = argv[8].decode() if len(argv) > 8 else "?"
        except (OSError, ProcessLookupError):  # gone while we looked
            continue
    return stubs


def dead(pid: int) -> bool:
    """Gone, or a zombie its parent (tritonserver) has not reaped."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")


def supervise(server, stopping, log=print) -> int:
    """Waits for the server to exit, restarting it whenever one of its stubs dies or it exits on its
    own; `stopping()` says a signal asked it to stop (then `TritonServer.stop` drains and stops it).
    Returns the server's exit code."""
    restarts: deque[float] = deque()
    while True:
        stubs = stub_pids(server.process.pid)
        while server.process.poll() is None and not stopping():
            gone = sorted(f"{name} (pid {pid})" for pid, name in stubs.items() if dead(pid))
            if gone:
                cause = f"model stub(s) {', '.join(gone)} died"
                break
            time.sleep(POLL_S)
        else:
            code = server.process.poll()
            if stopping() or code is None:
                return server.stop()
            cause = f"tritonserver exited on its own (code {code})"
        now = time.monotonic()
        while restarts and now - restarts[0] > RESTART_WINDOW_S:
            restarts.popleft()
        if len(restarts) >= MAX_RESTARTS:
            log(f"zipmoe: {cause}; {MAX_RESTARTS} restarts in {RESTART_WINDOW_S:.0f} s already: giving up")
            server.kill()
            return 1
        restarts.append(now)
        log(f"zipmoe: {cause}; restarting tritonserver (in-flight requests fail)")
        try:
            server.restart()
            server.wait_ready()
        except (RuntimeError, TimeoutError) as e:
            log(f"zipmoe: the restarted server did not come up: {e}")
            server.kill()
            return 1
        log("zipmoe: ready again")
