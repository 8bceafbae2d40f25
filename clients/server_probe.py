"""What a load test asks a running server besides its answers: idle or not, its KV blocks back,
ready, and the memory of its processes (host RSS/PSS per process, GPU memory from nvidia-smi).

Used by the soak (`clients/soak.py`) between and after its runs; reads the server's metrics endpoint
(`triton_client.scrape_metrics`), its HTTP health and models' readiness, /proc of the server's process
group and `nvidia-smi`.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import threading
import time
import urllib.request

from zipmoe.clients.triton_client import scrape_metrics
from zipmoe.serve import DEFAULT_REPOSITORY
from zipmoe.supervisor import stub_pids


def wait_idle(metrics_url: str, timeout: float = 300) -> dict[str, float]:
    """Waits until moe_decoder runs and queues nothing and the metrics say so for two scrapes in a row
    (gauges are published every 100 ms while idle); returns the last scrape."""
    deadline, quiet = time.monotonic() + timeout, 0
    while True:
        m = scrape_metrics(metrics_url)
        idle = m.get("zipmoe_running_requests", 0) == 0 and m.get("zipmoe_waiting_requests", 0) == 0
        quiet = quiet + 1 if idle else 0
        if quiet >= 2:
            return m
        if time.monotonic() > deadline:
            raise TimeoutError(f"moe_decoder not idle after {timeout:.0f}s: running "
                               f"{m.get('zipmoe_running_requests')}, waiting {m.get('zipmoe_waiting_requests')}")
        time.sleep(0.2)


def wait_blocks_back(metrics_url: str, timeout: float = 30) -> dict[str, float]:
    """The last scrape, as soon as every KV block is free (or when `timeout` passes)."""
    deadline = time.monotonic() + timeout
    while True:
        m = scrape_metrics(metrics_url)
        if m.get("zipmoe_kv_blocks_free") == m.get("zipmoe_kv_blocks_total") or time.monotonic() > deadline:
            return m
        time.sleep(0.2)


# The models of the project's model repository (each a folder with its config.pbtxt).
REPOSITORY_MODELS = tuple(sorted(p.parent.name for p in DEFAULT_REPOSITORY.glob("*/config.pbtxt")))


def ready(http_url: str) -> bool:
    try:
        with urllib.request.urlopen(f"http://{http_url}/v2/health/ready", timeout=10) as r:
            return r.status == 200
    except Exception:  # noqa: BLE001 -- not ready, whatever the reason
        return False


def models_not_ready(http_url: str, models=REPOSITORY_MODELS) -> list[str]:
    """Those of `models` whose readiness endpoint does not answer 200 (the repository index, which
    would give their states, answers only `zipmoe serve`'s own admin key)."""
    not_ready = []
    for model in models:
        try:
            with urllib.request.urlopen(f"http://{http_url}/v2/models/{model}/ready", timeout=10) as r:
                if r.status != 200:
                    not_ready.append(f"{model}: HTTP {r.status}")
        except Exception as e:  # noqa: BLE001 -- not ready, whatever the reason
            not_ready.append(f"{model}: {type(e).__name__}: {e}")
    return not_ready


def _status_kb(pid: int, key: str) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def _pss_kb(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def _nvidia_smi(query: str) -> list[list[str]] | None:
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(["nvidia-smi", query, "--format=csv,noheader,nounits"], stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    return [[p.strip() for p in line.split(",")] for line in out.stdout.splitlines() if line.strip()]


def gpu_memory(pids: list[int]) -> dict | None:
    """nvidia-smi's used GPU memory: per process of `pids` (compute apps), and of the whole devices
    (what counts where the server runs in another PID namespace than nvidia-smi sees). None without it."""
    apps, devices = _nvidia_smi("--query-compute-apps=pid,used_memory"), _nvidia_smi("--query-gpu=memory.used")
    if apps is None and devices is None:
        return None
    per_pid: dict[int, float] = {}
    for row in apps or []:
        if len(row) == 2 and row[0].isdigit() and int(row[0]) in pids:
            try:
                per_pid[int(row[0])] = per_pid.get(int(row[0]), 0.0) + float(row[1])
            except ValueError:
                pass
    device = sum(float(r[0]) for r in devices or [] if r and r[0].replace(".", "", 1).isdigit())
    return {"per_pid": per_pid, "device_used_mb": device, "apps_listed": len(apps or [])}


def memory_snapshot(server_pid: int | None, gpu: bool = True) -> dict | None:
    """Host RSS (and PSS) of the server's process group, per process and in all; GPU memory when
    nvidia-smi is there: `gpu_mb` is the group's processes' use, or the devices' use when nvidia-smi
    lists none of them (another PID namespace)."""
    if server_pid is None:
        return None
    # tritonserver runs in a session of its own; its Python stubs are in its process group.
    names = {server_pid: "tritonserver", **stub_pids(os.getpgid(server_pid))}
    pids = sorted(names)
    rss = {pid: _status_kb(pid, "VmRSS") / 1024 for pid in pids}
    pss = {pid: _pss_kb(pid) / 1024 for pid in pids}
    g = gpu_memory(pids) if gpu else None
    snap = {"time": time.time(), "processes": len(pids), "rss_mb": round(sum(rss.values()), 1),
            "pss_mb": round(sum(pss.values()), 1),
            "per_process": {f"{names[p]}[{p}]": {"rss_mb": round(rss[p], 1), "pss_mb": round(pss[p], 1),
                                                 **({"gpu_mb": g["per_pid"].get(p, 0.0)} if g else {})}
                            for p in pids}}
    if g is not None:
        snap["gpu_device_used_mb"] = g["device_used_mb"]
        snap["gpu_mb"] = round(sum(g["per_pid"].values()), 1) if g["per_pid"] else g["device_used_mb"]
        snap["gpu_mb_of"] = "the server's processes" if g["per_pid"] else "all processes on the GPUs"
    return snap


class MemorySampler:
    """Samples the server's memory every `period` seconds on a thread, for a timeline of the run."""

    def __init__(self, server_pid: int | None, period: float):
        self.server_pid, self.period, self.samples = server_pid, period, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="soak-memory", daemon=True)

    def _run(self):
        t0 = time.monotonic()
        while not self._stop.wait(self.period):
            snap = memory_snapshot(self.server_pid)
            if snap is not None:
                self.samples.append([round(time.monotonic() - t0, 1), snap["rss_mb"], snap.get("gpu_mb")])

    def __enter__(self):
        if self.server_pid is not None:
            self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=60)
