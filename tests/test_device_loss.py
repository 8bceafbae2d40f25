"""A lost CUDA context (serving/device_loss.py): errors that pass are told apart from it; moe_decoder's
service answers whoever waits with it and ends the process; through `zipmoe serve`, the streams in
flight get the error and the server comes back (the loss injected by a wrapper of moe_decoder's
model.py in a copy of the repository); on a GPU, a device-side assert is a lost context and an
out-of-memory error is not."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
from contextlib import contextmanager

import pytest
import torch

from zipmoe import serve
from zipmoe.clients.server_probe import ready
from zipmoe.clients.triton_client import ServerError, grpc_generate
from zipmoe.serving import decoder as decoder_module
from zipmoe.serving import device_loss
from zipmoe.serving.decode_request import DecodeRequest

from test_decoder_service import PROMPT, Sink, make_service
from test_images_server import note
from test_supervisor import stop, wait_for


def test_an_error_on_the_cpu_or_out_of_memory_is_no_lost_device():
    assert not device_loss.device_lost(RuntimeError("broken"), "cpu")
    assert not device_loss.device_lost(torch.OutOfMemoryError("CUDA out of memory"), "cuda")  # the device not asked


def test_the_process_ends_at_once_or_after_the_delay(monkeypatch):
    exits, logged, exited = [], [], threading.Event()
    monkeypatch.setattr(device_loss, "_exit", lambda code: exits.append(code) or exited.set())
    device_loss.end_process(logged.append, "gone")
    assert exits == [device_loss.EXIT_CODE] and logged == ["gone"]
    exited.clear()
    device_loss.end_process(logged.append, "soon", delay_s=0.2)
    assert len(exits) == 1 and logged == ["gone", "soon"]  # the timer has not fired yet
    assert exited.wait(10) and exits == [device_loss.EXIT_CODE] * 2


def test_a_lost_device_answers_whoever_waits_and_ends_the_process(tiny_checkpoint, monkeypatch):
    """The first request is in the failing step; two more wait in the queue meanwhile. Each gets the
    error before the process ends; none after it is queued."""
    sinks, exits, exited = [Sink() for _ in range(3)], [], threading.Event()

    def fake_exit(code):
        exits.append((code, [sink.done.is_set() for sink in sinks]))  # answered before the exit?
        exited.set()

    monkeypatch.setattr(device_loss, "_exit", fake_exit)
    monkeypatch.setattr(decoder_module, "device_lost", lambda error, device: True)
    svc = make_service(tiny_checkpoint)
    in_step, go, steps = threading.Event(), threading.Event(), []

    def broken_step():
        steps.append(1)
        in_step.set()
        assert go.wait(30)
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    svc.engine.step = broken_step
    svc.submit(DecodeRequest(list(PROMPT), {"max_tokens": 4}), sinks[0])
    assert in_step.wait(30)
    for sink in sinks[1:]:  # queued while the step runs
        svc.submit(DecodeRequest(list(PROMPT), {"max_tokens": 4}), sink)
    go.set()
    assert exited.wait(30)
    svc._thread.join(10)
    assert not svc._thread.is_alive() and len(steps) == 1  # no step after the one that failed
    assert exits == [(device_loss.EXIT_CODE, [True, True, True])]
    for sink in sinks:  # each answered once, with what happened
        assert len(sink.errors) == 1 and sink.finals == 0
        assert "internal error" in sink.errors[0] and "CUDA context is lost" in sink.errors[0]
    with pytest.raises(RuntimeError, match="CUDA context is lost"):  # later requests are refused at once
        svc.submit(DecodeRequest(list(PROMPT), {"max_tokens": 4}), Sink())
    svc.lose_device(RuntimeError("again"))  # a second call does nothing
    assert len(exits) == 1
    svc.shutdown()


def test_an_error_that_passes_fails_the_requests_in_flight_and_the_service_goes_on(tiny_checkpoint, monkeypatch):
    monkeypatch.setattr(device_loss, "_exit", lambda code: pytest.fail("the process must not end"))
    svc = make_service(tiny_checkpoint)
    step, failed = svc.engine.step, []

    def step_once_broken():
        if not failed:
            failed.append(1)
            raise RuntimeError("a bug")
        return step()

    svc.engine.step = step_once_broken
    first = Sink()
    svc.submit(DecodeRequest(list(PROMPT), {"max_tokens": 4}), first)
    assert first.done.wait(30) and "internal error" in first.errors[0] and "CUDA" not in first.errors[0]
    second = Sink()
    svc.submit(DecodeRequest(list(PROMPT), {"max_tokens": 4}), second)
    assert second.done.wait(60) and not second.errors and second.finals == 1
    svc.shutdown()


# A model's model.py in the test's copy of the repository: the first call of {owner}.{method} after the
# file named by $ZIPMOE_TEST_LOSE_DEVICE appears removes it and fails as a lost CUDA context would.
FAULTY_MODEL = """
import importlib
import os

from zipmoe.models.{model} import TritonPythonModel as Model


class TritonPythonModel(Model):
    def initialize(self, args):
        super().initialize(args)
        trigger, owner = os.environ["ZIPMOE_TEST_LOSE_DEVICE"], self.{owner}
        call = owner.{method}

        def call_or_lose(*args):
            if os.path.exists(trigger):
                os.remove(trigger)
                # what the probe (device_loss.device_lost) says on a GPU after such an error
                importlib.import_module("{decides}").device_lost = lambda error, device: True
                raise RuntimeError("CUDA error: an illegal memory access was encountered (injected)")
            return call(*args)

        owner.{method} = call_or_lose
"""
FAULTS = {  # where the loss shows -> the model, the object and method that fail, the module whose device_lost decides
    "engine step": dict(model="moe_decoder", owner="service.engine", method="step", decides="zipmoe.serving.decoder"),
    "request taken in": dict(model="moe_decoder", owner="service", method="submit",
                             decides="zipmoe.models.moe_decoder"),
    "vision forward": dict(model="vision_encoder", owner="encoder", method="features",
                           decides="zipmoe.models.vision_encoder"),
}


@contextmanager
def lose_the_device_in(where: str, checkpoint, tmp_path):
    """`zipmoe serve` over a copy of the repository whose model loses its device at FAULTS[where] once
    the yielded trigger file appears; yields (trigger, gRPC URL, HTTP URL, serve's log, its process)."""
    repository = tmp_path / "repository"
    shutil.copytree(serve.DEFAULT_REPOSITORY, repository, ignore=shutil.ignore_patterns("__pycache__"))
    fault = FAULTS[where]
    (repository / fault["model"] / "1" / "model.py").write_text(FAULTY_MODEL.format(**fault))
    trigger, log = tmp_path / "lose-the-device", tmp_path / "serve.log"
    http, grpc, metrics = serve.free_ports(3)
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "zipmoe.cli", "serve", "--checkpoint", str(checkpoint),
                                 "--model-repository", str(repository), "--http-port", str(http),
                                 "--grpc-port", str(grpc), "--metrics-port", str(metrics),
                                 "--log-file", str(tmp_path / "triton.log")],
                                env={**os.environ, "ZIPMOE_TEST_LOSE_DEVICE": str(trigger)},
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for(log, "zipmoe: ready", 300, proc)
        yield trigger, f"127.0.0.1:{grpc}", f"127.0.0.1:{http}", log, proc
    finally:
        stop(proc)


def streams(grpc: str, count: int) -> tuple[list[threading.Thread], list]:
    """`count` long streams started on `grpc`; each appends (outcome, message) when it ends."""
    outcomes: list = []

    def stream():
        try:
            for _ in grpc_generate(grpc, text_input="tell me everything", max_tokens=1000, ignore_eos=True,
                                   stream=True, timeout=60):
                pass
            outcomes.append(("finished", ""))
        except Exception as e:  # noqa: BLE001 -- what the client sees is the point
            outcomes.append((type(e).__name__, str(e)))

    threads = [threading.Thread(target=stream) for _ in range(count)]
    for t in threads:
        t.start()
    return threads, outcomes


def comes_back(grpc: str, http: str, log, proc) -> None:
    wait_for(log, "zipmoe: ready again", 300, proc)
    answer = list(grpc_generate(grpc, text_input="still there?", images=[note(0)], max_tokens=3, ignore_eos=True))
    assert answer[-1]["output_token_count"] == 3 and ready(http)


@pytest.mark.integration
@pytest.mark.parametrize("where", ["engine step", "request taken in"])
def test_through_zipmoe_serve_a_lost_decoder_device_ends_the_streams_and_the_server_comes_back(tiny_checkpoint,
                                                                                               tmp_path, where):
    """Lost in a step, or while moe_decoder takes a new request in: the streams in flight (and the new
    request) each end with the error, and the server comes back."""
    with lose_the_device_in(where, tiny_checkpoint, tmp_path) as (trigger, grpc, http, log, proc):
        threads, outcomes = streams(grpc, 4)
        time.sleep(2)  # the streams are decoding
        trigger.touch()
        lost = time.monotonic()
        if where == "request taken in":
            with pytest.raises(ServerError, match="moe_decoder: internal error: the GPU's CUDA context is lost"):
                list(grpc_generate(grpc, text_input="one more", max_tokens=3, timeout=60))
        for t in threads:
            t.join(60)
        assert len(outcomes) == 4 and all("CUDA context is lost" in message for _, message in outcomes), outcomes
        assert time.monotonic() - lost < 30 and not trigger.exists()
        comes_back(grpc, http, log, proc)


@pytest.mark.integration
def test_through_zipmoe_serve_a_lost_vision_device_fails_the_image_request_and_the_server_comes_back(
        tiny_checkpoint, tmp_path):
    with lose_the_device_in("vision forward", tiny_checkpoint, tmp_path) as (trigger, grpc, http, log, proc):
        trigger.touch()
        with pytest.raises(ServerError, match="vision_encoder: internal error: the GPU's CUDA context is lost"):
            list(grpc_generate(grpc, text_input="What?", images=[note(0)], max_tokens=3, timeout=60))
        assert not trigger.exists()
        comes_back(grpc, http, log, proc)  # the stub ended a second after its answer


LOSE_THE_DEVICE = """
import torch
from zipmoe.serving.device_loss import device_lost
try:
    torch.empty(1 << 50, dtype=torch.uint8, device="cuda")
except torch.OutOfMemoryError as e:
    print("after out of memory:", device_lost(RuntimeError(str(e)), "cuda"))
x = torch.zeros(4, device="cuda")
try:
    x[torch.tensor([1 << 20], device="cuda")] += 1  # out of range: a device-side assert
    torch.cuda.synchronize()
except Exception as e:
    print("after a device-side assert:", device_lost(e, "cuda"))
"""


@pytest.mark.gpu
def test_on_a_gpu_a_device_side_assert_loses_the_device_and_out_of_memory_does_not():
    out = subprocess.run([sys.executable, "-c", LOSE_THE_DEVICE], capture_output=True, text=True, timeout=300).stdout
    assert "after out of memory: False" in out and "after a device-side assert: True" in out
