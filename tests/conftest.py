"""Shared fixtures: the tiny checkpoint, a v2 smoke checkpoint, a real tritonserver on loopback, and the gpu marker."""
from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

import zipmoe.kernels  # noqa: F401  first: it picks Triton's interpreter on CPU before transformers imports triton
from zipmoe import serve
from zipmoe.build.tiny_checkpoint import build_tiny_checkpoint

REPO = Path(__file__).resolve().parents[1]
HAS_CUDA = torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    """`gpu` tests need CUDA. With CUDA present the integration tests run there too (the engine
    picks cuda by itself), so `pytest -m gpu` on a GPU machine also runs the whole server suite."""
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if HAS_CUDA and "integration" in item.keywords:
            item.add_marker(pytest.mark.gpu)
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A test that fails while a tritonserver fixture serves it shows that server's last log lines:
    a race seen once in CI (session 28: a request answered with no response) leaves its evidence."""
    outcome = yield
    report = outcome.get_result()
    if report.when != "call" or not report.failed:
        return
    for name, value in getattr(item, "funcargs", {}).items():
        if isinstance(value, serve.TritonServer) and value.log_path is not None:
            report.sections.append((f"tritonserver log of fixture {name}", serve.log_tail(value.log_path, 120)))


@pytest.fixture(scope="session")
def tiny_checkpoint() -> Path:
    return build_tiny_checkpoint(REPO / "checkpoints" / "tiny")


@pytest.fixture(scope="session")
def v2_smoke(tmp_path_factory):
    """build/train_v2.py's --smoke run (tokenizer, 2 steps of 2 examples, validation, saving, SERE
    calibration): (checkpoint directory, training log)."""
    from zipmoe.build.train_v2 import SMOKE, train

    out = tmp_path_factory.mktemp("v2smoke")
    return out, train(out, **SMOKE)


@contextmanager
def tiny_server(checkpoint, tmp_path_factory, name: str, overrides: dict | None = None):
    """The project's model repository over `checkpoint` on free loopback ports, ready, with its
    config.pbtxt `overrides` ({model: {parameter: value}}); its log is `server.log` in a fresh folder
    `name` (server.log_path)."""
    log = tmp_path_factory.mktemp(name) / "server.log"
    ports = serve.free_server_ports()
    with serve.TritonServer(serve.DEFAULT_REPOSITORY, checkpoint=str(checkpoint), log_path=log,
                            overrides=overrides, **ports) as s:
        s.wait_ready(timeout=300)
        yield s
    # Every model's stub ends cleanly at shutdown (a metric family left to the stub's own exit crashed it).
    crashes = log.read_text(errors="replace").count("Fatal Python error")
    assert not crashes, f"{crashes} Python stub(s) crashed at shutdown: {log}"


@pytest.fixture(scope="session")
def zipmoe_server(tiny_checkpoint, tmp_path_factory):
    """The project's model repository served on free loopback ports, shared by the integration tests."""
    with tiny_server(tiny_checkpoint, tmp_path_factory, "server") as s:
        yield s


@pytest.fixture(scope="session")
def sere_server(tiny_checkpoint, tmp_path_factory):
    """A second server whose moe_decoder routes decode steps with SERE (the tiny checkpoint calibrated)."""
    from zipmoe.build.sere_calibrate import calibrate
    from zipmoe.sere_file import load_sere

    try:
        load_sere(tiny_checkpoint)
    except (FileNotFoundError, ValueError):  # missing, or left from an earlier build of the checkpoint
        calibrate(tiny_checkpoint)
    # The tiny checkpoint is random: its experts are nearly equally unlike (similarity ~0.07), so the
    # default threshold 0.5 would move nothing; rho = 0 always moves to the most similar primary.
    overrides = {"moe_decoder": {"routing_policy": "sere", "sere_threshold": "0.0"}}
    with tiny_server(tiny_checkpoint, tmp_path_factory, "sere_server", overrides) as s:
        yield s
