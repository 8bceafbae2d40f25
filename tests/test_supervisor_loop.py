"""supervise()'s decisions with a stand-in server (no tritonserver): a server that exits when no
signal asked it to is restarted like one whose stub died; a signal ends it; too many restarts give up."""
from __future__ import annotations

from types import SimpleNamespace

from zipmoe import supervisor


class FakeServer:
    """Exits on its own `crashes` times (each new process a little later), then runs until stopped."""

    def __init__(self, crashes: int):
        self.crashes, self.events = crashes, []
        self._new_process()

    def _new_process(self):
        code = 134 if self.crashes > 0 else None  # SIGABRT, as the lock_exception abort exits
        self.crashes -= 1
        self.process = SimpleNamespace(pid=4242, poll=lambda: code)

    def restart(self):
        self.events.append("restart")
        self._new_process()

    def wait_ready(self):
        self.events.append("ready")

    def kill(self):
        self.events.append("kill")

    def stop(self):
        self.events.append("stop")
        return 0


def test_a_server_that_exits_on_its_own_is_restarted(monkeypatch):
    monkeypatch.setattr(supervisor, "stub_pids", lambda group: {})
    monkeypatch.setattr(supervisor.time, "sleep", lambda s: None)
    server, polls, lines = FakeServer(crashes=2), iter(range(10_000)), []
    stopping = lambda: next(polls) > 50  # noqa: E731 -- a signal arrives after a while
    assert supervisor.supervise(server, stopping, log=lines.append) == 0
    assert server.events == ["restart", "ready", "restart", "ready", "stop"]
    assert lines[0] == "zipmoe: tritonserver exited on its own (code 134); restarting tritonserver (in-flight requests fail)"
    assert lines.count("zipmoe: ready again") == 2


def test_too_many_exits_give_up(monkeypatch):
    monkeypatch.setattr(supervisor, "stub_pids", lambda group: {})
    server, lines = FakeServer(crashes=supervisor.MAX_RESTARTS + 1), []
    assert supervisor.supervise(server, lambda: False, log=lines.append) == 1
    assert server.events.count("restart") == supervisor.MAX_RESTARTS and server.events[-1] == "kill"
    assert "giving up" in lines[-1]
