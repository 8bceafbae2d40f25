"""Free loopback ports (and whether one is taken), for a tritonserver (`serve.py`) and for the
expert-parallel engines' process group (`engine/parallel_engine.py`): here, so that the Triton-free
core need not import the serving module for them."""
from __future__ import annotations

import socket


def free_ports(n: int) -> list[int]:
    """n distinct free loopback ports. Every socket stays bound until all are: asked one at a time,
    the system can hand back a port just released, and a server given one port for both HTTP and
    gRPC refuses to start (seen in CI)."""
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def free_port() -> int:
    return free_ports(1)[0]


def port_in_use(host: str, port: int) -> bool:
    """Whether a server listens on host:port (a connection is accepted), as a new one would find it."""
    with socket.socket() as s:
        s.settimeout(1.0)
        return s.connect_ex(("127.0.0.1" if host == "0.0.0.0" else host, port)) == 0
