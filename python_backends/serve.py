"""Launch tritonserver on the zipmoe model repository (`TritonServer`; the `zipmoe serve` command
line around it is `serve_command.py`).

Works with three servers: one named by $TRITONSERVER or found on PATH, the NGC
image's /opt/tritonserver, or the binary bundled in the nvidia-pytriton wheel.
The bundled one needs extra setup: a backend
directory holding the Python stub for this interpreter, the wheel's shared libs
and this interpreter's libpython on LD_LIBRARY_PATH, and the venv's bin/ first
on PATH, since the stub finds its prefix (and site-packages) like a python3 on
PATH and ignores PYTHONPATH.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from collections import deque
from pathlib import Path

from .drain import ADMIN_HEADER, DRAIN_TIMEOUT_S, drain, repository_index
from .ports import free_port, free_ports, port_in_use  # noqa: F401  (serve.free_port: the clients' and tests' name)
# The repository copy a server runs (config.pbtxt edits): its own module; the launchers reach it here.
from .repository_config import render_repository
from .serving.shared_level import server_segments

EXIT_TIMEOUT_S = 15  # tritonserver's wait for requests in flight and models unloading at exit (default 30)

DEFAULT_REPOSITORY = Path(__file__).resolve().parents[1] / "model_repository"
# The trained notes checkpoint (build/train_tiny.py), committed: what the demo and `zipmoe eval` use.
TRAINED_CHECKPOINT = DEFAULT_REPOSITORY.parent / "checkpoints" / "notes"
# The tiny random checkpoint, built on demand (build/tiny_checkpoint.py): tests and benchmarks.
TINY_CHECKPOINT = DEFAULT_REPOSITORY.parent / "checkpoints" / "tiny"
# Qwen3-VL-30B-A3B-Instruct's configs and a tokenizer, no weights (build/config_only.py): --load-format dummy.
REAL_SHAPE_CHECKPOINT = DEFAULT_REPOSITORY.parent / "checkpoints" / "qwen3-vl-30b-a3b"
NGC_SERVER = Path("/opt/tritonserver/bin/tritonserver")
# Triton's pool on each GPU for the tensors models hand each other there. The server's 64 MB default holds
# half of one 30-image request's visual tensors at the 30B shape (keep 1.0: 4 x 7,680 x 2,048 bf16 =
# 126 MB); past it every response falls back to CUDA IPC (the log's "Failed to allocate memory from CUDA
# memory pool"). The 30B benchmarks ran with this size.
CUDA_POOL_BYTES = 1 << 30


def _bundled_server() -> Path | None:
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0]) / "tritonserver" / "bin" / "tritonserver"


def find_tritonserver() -> Path:
    """$TRITONSERVER, then PATH, then the NGC location, then the nvidia-pytriton binary."""
    if os.environ.get("TRITONSERVER"):  # an explicit choice that is wrong is an error, not a hint
        path = Path(os.environ["TRITONSERVER"])
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise FileNotFoundError(f"$TRITONSERVER={path} is not an executable file")
        return path
    candidates: list[tuple[str, Path | None]] = [
        ("tritonserver on PATH", Path(p) if (p := shutil.which("tritonserver")) else None),
        ("NGC image", NGC_SERVER),
        ("nvidia-pytriton wheel", _bundled_server()),
    ]
    for _, path in candidates:
        if path is not None and path.is_file() and os.access(path, os.X_OK):
            return path
    tried = "\n".join(f"  {what}: {path or 'not found'}" for what, path in candidates)
    raise FileNotFoundError(f"no tritonserver binary found; tried:\n{tried}")


def _stubs_dir(server: Path) -> Path:
    # The wheel lays out tritonserver/{bin,backends,python_backend_stubs}; NGC has no stubs folder.
    return server.parent.parent / "python_backend_stubs"


def _is_bundled(server: Path) -> bool:
    return _stubs_dir(server).is_dir()


def prepare_backend_dir(server: Path, work: Path) -> Path | None:
    """For the bundled server, build work/backends/python with the stub for this interpreter.

    Returns the directory for --backend-directory, or None for a server that has its
    own complete backends/ (NGC, system install)."""
    if not _is_bundled(server):
        return None
    version = "%d.%d" % sys.version_info[:2]
    stub = _stubs_dir(server) / version / "triton_python_backend_stub"
    if not stub.is_file():
        available = sorted(p.name for p in _stubs_dir(server).iterdir() if p.is_dir())
        raise FileNotFoundError(
            f"the bundled tritonserver has no Python {version} backend stub; available: {', '.join(available)}"
        )
    source = server.parent.parent / "backends" / "python"
    backends = work / "backends"
    target = backends / "python"
    target.mkdir(parents=True, exist_ok=True)
    for path in (source / "libtriton_python.so", source / "triton_python_backend_utils.py", stub):
        link = target / path.name
        link.unlink(missing_ok=True)
        link.symlink_to(path.resolve())
    return backends


def server_env(server: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")]).rstrip(os.pathsep)
    # This interpreter's libpython first, or the stub loads the system one and the venv's
    # extension modules fail with undefined symbols.
    libs = [sysconfig.get_config_var("LIBDIR")]
    if _is_bundled(server):
        libs.append(str(server.parents[3] / "nvidia_pytriton.libs"))  # site-packages/nvidia_pytriton.libs
    if env.get("LD_LIBRARY_PATH"):
        libs.append(env["LD_LIBRARY_PATH"])
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in libs if p)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def cuda_pool_args(extra_args: list[str]) -> list[str]:
    """--cuda-memory-pool-byte-size for every GPU this process sees, unless the caller set the pool."""
    if any(arg.startswith("--cuda-memory-pool-byte-size") for arg in extra_args):
        return []
    import torch

    return [f"--cuda-memory-pool-byte-size={gpu}:{CUDA_POOL_BYTES}" for gpu in range(torch.cuda.device_count())]


def free_server_ports() -> dict[str, int]:
    """`TritonServer`'s http_port, grpc_port and metrics_port: three distinct free loopback ports."""
    return dict(zip(("http_port", "grpc_port", "metrics_port"), free_ports(3)))


def log_tail(path: Path | None, lines: int = 60) -> str:
    """The last `lines` lines of a server log (what an error about the server shows)."""
    if path is None:
        return "(server output went to this terminal, see above)"
    try:
        with open(path, errors="replace") as f:
            return "".join(deque(f, maxlen=lines))
    except FileNotFoundError:
        return "(no log written)"


class TritonServer:
    """A tritonserver process on a rendered copy of a model repository.

    url_http / url_grpc are "host:port", as tritonclient wants them."""

    def __init__(
        self,
        model_repository,
        http_port: int = 8000,
        grpc_port: int = 8001,
        metrics_port: int = 8002,
        checkpoint: str | None = None,
        log_path=None,
        extra_args=(),
        host: str = "127.0.0.1",
        overrides: dict[str, dict[str, str]] | None = None,
    ):
        self.model_repository = Path(model_repository)
        self.http_port, self.grpc_port, self.metrics_port = http_port, grpc_port, metrics_port
        self.checkpoint = checkpoint
        self.overrides = overrides
        self.log_path = Path(log_path) if log_path is not None else None
        self.extra_args = list(extra_args)
        self.host = host
        self.process: subprocess.Popen | None = None
        self._workdir: Path | None = None
        self.ready = False  # wait_ready() saw every model loaded: stop() drains
        self._stop_now = False
        self._shm_prefix: str | None = None
        self._repository: Path | None = None
        self._admin_key = uuid.uuid4().hex

    @property
    def _client_host(self) -> str:
        return "127.0.0.1" if self.host == "0.0.0.0" else self.host

    @property
    def url_http(self) -> str:
        return f"{self._client_host}:{self.http_port}"

    @property
    def url_grpc(self) -> str:
        return f"{self._client_host}:{self.grpc_port}"

    @property
    def url_metrics(self) -> str:
        return f"{self._client_host}:{self.metrics_port}"

    def check_ports(self) -> None:
        """RuntimeError when a port is in use: wait_ready() would hear another server there (whose
        models a drain would then unload)."""
        taken = [port for port in (self.http_port, self.grpc_port, self.metrics_port) if port_in_use(self.host, port)]
        if taken:
            raise RuntimeError(f"port(s) {', '.join(map(str, taken))} on {self.host} in use: another server runs "
                               "there (stop it, or give --http-port/--grpc-port/--metrics-port)")

    def start(self) -> None:
        self.ready, self._stop_now = False, False
        server = find_tritonserver()
        self.check_ports()
        self._workdir = Path(tempfile.mkdtemp(prefix="zipmoe-serve-"))
        repo = render_repository(self.model_repository, self._workdir / "model_repository", self.checkpoint,
                                 self.overrides)
        self._repository = repo
        cmd = [
            str(server),
            f"--model-repository={repo}",
            f"--http-address={self.host}",
            f"--http-port={self.http_port}",
            f"--grpc-address={self.host}",
            f"--grpc-port={self.grpc_port}",
            f"--metrics-address={self.host}",
            f"--metrics-port={self.metrics_port}",
            "--log-verbose=0",
            "--exit-on-error=true",
            # Every model loaded at start, as without model control, and the entry models unloaded
            # one by one when the server drains before it stops (drain.py). The repository API (index,
            # load, unload) answers only requests with this server's admin key: no client can unload a model.
            "--model-control-mode=explicit",
            "--load-model=*",
            f"--http-restricted-api=model-repository:{ADMIN_HEADER}={self._admin_key}",
            f"--grpc-restricted-protocol=model-repository:{ADMIN_HEADER}={self._admin_key}",
            # What is still in flight after a drain is past its deadline, or a model 2.51 never lets go
            # (drain.py): drain (25 s) and exit stay within a minute, Kubernetes' grace period.
            f"--exit-timeout-secs={EXIT_TIMEOUT_S}",
            # Configs are complete; don't let backends guess missing fields.
            "--disable-auto-complete-config",
        ]
        backends = prepare_backend_dir(server, self._workdir)
        if backends is not None:
            cmd.append(f"--backend-directory={backends}")
        if not any("shm-region-prefix-name" in arg for arg in self.extra_args):
            # The Python stubs' shared memory under a name of this server's own, so that what a server
            # that did not exit cleanly (its exit timeout, a crash) left in /dev/shm can be removed.
            self._shm_prefix = f"zipmoe_{uuid.uuid4().hex[:12]}_"
            cmd.append(f"--backend-config=python,shm-region-prefix-name={self._shm_prefix}")
        cmd += cuda_pool_args(self.extra_args) + self.extra_args
        log = open(self.log_path, "ab") if self.log_path is not None else None
        try:
            # Own session: signals typed at our terminal are not delivered to it directly,
            # and stop() can clean up the whole group (server + stub processes).
            self.process = subprocess.Popen(
                cmd, env=server_env(server), stdin=subprocess.DEVNULL,
                stdout=log, stderr=subprocess.STDOUT if log else None, start_new_session=True,
            )
        finally:
            if log is not None:
                log.close()

    @property
    def admin_headers(self) -> dict[str, str]:
        """What a request to the repository API (index, load, unload) must carry."""
        return {ADMIN_HEADER: self._admin_key}

    def _request(self, method: str, path: str):
        with urllib.request.urlopen(urllib.request.Request(f"http://{self.url_http}{path}", method=method),
                                    timeout=10) as r:
            return r.status, r.read()

    def wait_ready(self, timeout: float = 300) -> list[str]:
        """Wait for /v2/health/ready and the metrics endpoint (the server starts it tens of ms after
        the HTTP one: a scrape right after ready was refused), then check every model is READY;
        returns the model names."""
        deadline = time.monotonic() + timeout
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"tritonserver exited with code {self.process.returncode} before ready:\n{log_tail(self.log_path)}"
                )
            try:
                if self._request("GET", "/v2/health/ready")[0] == 200:
                    if "--allow-metrics=false" not in self.extra_args:
                        urllib.request.urlopen(f"http://{self.url_metrics}/metrics", timeout=10).close()
                    break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass  # not listening yet, or models still loading (400)
            if time.monotonic() > deadline:
                raise TimeoutError(f"tritonserver not ready after {timeout:.0f}s:\n{log_tail(self.log_path)}")
            time.sleep(0.25)
        models = repository_index(self.url_http, self.admin_headers)
        failed = [m for m in models if m.get("state") != "READY"]
        if failed:
            details = "\n".join(f"  {m['name']}: {m.get('state')} {m.get('reason', '')}" for m in failed)
            raise RuntimeError(f"models not ready:\n{details}")
        self.ready = True
        return sorted({m["name"] for m in models})

    def send_signal(self, signum: int) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signum)

    def stop_now(self) -> None:
        """A second Ctrl-C: the server and its stubs are killed at once (requests still running fail)."""
        self._stop_now = True
        if self.process is not None:
            self._kill_group()

    def stop(self, timeout: float = EXIT_TIMEOUT_S + 5, drain_timeout: float = DRAIN_TIMEOUT_S,
             log=print) -> int | None:
        """Drains a ready server (drain.py: requests in flight finish, new ones are refused), then
        SIGINT, then SIGTERM, then SIGKILL; returns the server's exit code."""
        if self.process is None:
            return None
        if self.ready and self.process.poll() is None and not self._stop_now:
            self.ready = False
            drain(self.url_http, self.url_metrics, self.admin_headers, drain_timeout,
                  running=lambda: self.process.poll() is None and not self._stop_now, log=log)
        for signum, wait in ((signal.SIGINT, timeout), (signal.SIGTERM, 5)):
            self.send_signal(signum)
            try:
                self.process.wait(wait)
                break
            except subprocess.TimeoutExpired:
                pass
        else:
            self._kill_group()
            self.process.wait()
        # Stub processes notice the server is gone on their own; give them a moment, then force.
        for _ in range(40):
            if not self._group_alive():
                break
            time.sleep(0.05)
        else:
            self._kill_group()
        self._remove_shared_memory()
        return self.process.returncode

    def kill(self) -> None:
        """SIGKILL to the whole group (server and stubs) at once: connections close, requests end."""
        self._kill_group()
        self.process.wait()
        for _ in range(100):
            if not self._group_alive():
                break
            time.sleep(0.05)
        self._remove_shared_memory()

    def _remove_shared_memory(self) -> None:
        """What a server that is gone left in shared memory (nothing after a clean exit): its stubs'
        regions, and its models' segments (serving/shared_level.py: the keep-ratio level, the GPU turn)."""
        if self._shm_prefix is not None and Path("/dev/shm").is_dir():
            for region in Path("/dev/shm").glob(f"{self._shm_prefix}*"):
                region.unlink(missing_ok=True)
        for segment in server_segments(self._repository) if self._repository is not None else ():
            segment.unlink(missing_ok=True)

    def restart(self) -> None:
        """Kills the server and starts a new one on the same ports and configuration."""
        self.kill()
        if self._workdir is not None:
            shutil.rmtree(self._workdir, ignore_errors=True)
        self.start()

    def _group_alive(self) -> bool:
        try:
            os.killpg(self.process.pid, 0)
            return True
        except ProcessLookupError:
            return False

    def _kill_group(self) -> None:
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def __enter__(self) -> "TritonServer":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.stop()
        finally:
            if self._workdir is not None:
                shutil.rmtree(self._workdir, ignore_errors=True)
                self._workdir = None
