"""The OpenAI frontend under uvicorn, on a thread of the `zipmoe serve` process, beside tritonserver.

It reaches Triton through the gRPC address `zipmoe serve` gives it and serves HTTP on its own port.
A thread, not a process: it lives and dies with `zipmoe serve` (uvicorn leaves signals to the main
thread, which forwards them to tritonserver and then stops this).
"""
from __future__ import annotations

import threading
import time

import uvicorn

from .app import TritonBackend, create_app


class OpenAIFrontend:
    """`app` defaults to the app over Triton's gRPC endpoint at `grpc_url` (tests pass their own)."""

    def __init__(self, grpc_url: str | None = None, host: str = "127.0.0.1", port: int = 9000,
                 log_level: str = "warning", app=None):
        self.host, self.port = host, port
        app = app if app is not None else create_app(TritonBackend(grpc_url))
        config = uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on",
                                timeout_graceful_shutdown=5)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="zipmoe-openai", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{'127.0.0.1' if self.host == '0.0.0.0' else self.host}:{self.port}/v1"

    def start(self, timeout: float = 30) -> None:
        """Returns once it listens; RuntimeError when it cannot (the port is taken: uvicorn says why)."""
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the OpenAI frontend could not listen on {self.host}:{self.port}")
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)

    def __enter__(self) -> "OpenAIFrontend":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
