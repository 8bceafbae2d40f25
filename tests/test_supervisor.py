"""`zipmoe serve` survives a model's stub process dying (kill -9): the requests in flight get an
error within seconds, the server stops answering health checks, and it comes back and answers."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from zipmoe import serve
from zipmoe.clients.triton_client import grpc_generate
from zipmoe.clients.server_probe import ready
from zipmoe.supervisor import dead, stub_pids

pytestmark = pytest.mark.integration


def wait_for(log: Path, text: str, timeout: float, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + timeout
    while text not in log.read_text(errors="replace"):
        assert proc.poll() is None, f"zipmoe serve exited:\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"no {text!r} after {timeout} s:\n{log.read_text()[-3000:]}"
        time.sleep(0.2)


def stop(proc: subprocess.Popen) -> None:
    """Ends `zipmoe serve` as Ctrl-C does, or kills its process group after 60 s."""
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)


def server_group(http: int) -> int:
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                argv = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if argv[0].endswith(b"tritonserver") and f"--http-port={http}".encode() in argv:
                return os.getpgid(int(entry.name))
    raise AssertionError("no tritonserver process")


def test_a_dead_stub_fails_in_flight_requests_and_the_server_comes_back(tiny_checkpoint, tmp_path):
    http, grpc, metrics = serve.free_ports(3)
    log = tmp_path / "serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "zipmoe.cli", "serve", "--checkpoint", str(tiny_checkpoint),
                                 "--http-port", str(http), "--grpc-port", str(grpc), "--metrics-port", str(metrics),
                                 "--log-file", str(tmp_path / "triton.log")],
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for(log, "zipmoe: ready", 300, proc)
        decoder = next(pid for pid, name in stub_pids(server_group(http)).items() if name.startswith("moe_decoder"))
        outcomes: list = []

        def stream():
            try:
                for _ in grpc_generate(f"127.0.0.1:{grpc}", text_input="tell me everything", max_tokens=1000,
                                       ignore_eos=True, stream=True, timeout=60):
                    pass
                outcomes.append(("finished", time.monotonic()))
            except Exception as e:  # noqa: BLE001 -- what the client sees is the point
                outcomes.append((type(e).__name__, time.monotonic()))

        threads = [threading.Thread(target=stream) for _ in range(8)]
        for t in threads:
            t.start()
        time.sleep(2)  # the streams are decoding
        os.kill(decoder, signal.SIGKILL)
        killed = time.monotonic()
        saw_not_ready = False
        while not saw_not_ready and time.monotonic() - killed < 20:
            saw_not_ready = not ready(f"127.0.0.1:{http}")
            time.sleep(0.1)
        for t in threads:
            t.join(60)
        assert len(outcomes) == 8 and all(kind != "finished" and at - killed < 15 for kind, at in outcomes), outcomes
        assert saw_not_ready, "the health endpoint kept answering 200 after the stub died"
        assert dead(decoder)
        wait_for(log, "zipmoe: ready again", 300, proc)
        answer = list(grpc_generate(f"127.0.0.1:{grpc}", text_input="still there?", max_tokens=3, ignore_eos=True))
        assert answer[-1]["output_token_count"] == 3 and ready(f"127.0.0.1:{http}")
    finally:
        stop(proc)
