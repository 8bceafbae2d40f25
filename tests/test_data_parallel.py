"""Data parallel on the CPU: the device each model instance picks from Triton's instance args, the
threads that bind it, and the KV-cache plan measured on the instance's own GPU (fake CUDA memory
figures: no GPU needed). The server test with two moe_decoder instances is test_data_parallel_server.py."""
from __future__ import annotations

import threading

import pytest
import torch

from zipmoe.detokenize import TokenBytes
from zipmoe.engine import memory
from zipmoe.engine import engine as engine_module
from zipmoe.engine.engine import EngineConfig, LLMEngine
from zipmoe.models.io import instance_gpu
from zipmoe.serving import decoder as decoder_module
from zipmoe.serving.decoder import DecoderService
from zipmoe.settings import make_current, resolve_device, resolve_device_dtype

GIB = 1 << 30
GPU_ARGS = {"model_instance_kind": "GPU", "model_instance_device_id": "1"}


@pytest.fixture
def gpu_visible(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)


def test_triton_instance_args_name_the_gpu_of_kind_gpu_instances_only():
    assert instance_gpu(GPU_ARGS) == 1
    assert instance_gpu({"model_instance_kind": "CPU", "model_instance_device_id": "0"}) is None  # shipped configs
    assert instance_gpu({}) is None


def test_auto_and_cuda_mean_the_instance_gpu_and_an_explicit_choice_stays(gpu_visible):
    assert resolve_device("auto", 1) == "cuda:1"
    assert resolve_device("cuda", 1) == "cuda:1"
    assert resolve_device("cuda:0", 1) == "cuda:0"  # the operator's own choice
    assert resolve_device("cpu", 1) == "cpu"
    assert resolve_device("auto", None) == "cuda"  # KIND_CPU instance: as before, the current GPU
    assert resolve_device_dtype("auto", "auto", 1) == (torch.device("cuda", 1), torch.bfloat16)


def test_without_a_gpu_auto_is_the_cpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto", None) == "cpu" and resolve_device("auto", 1) == "cpu"
    assert resolve_device_dtype("auto", "auto") == (torch.device("cpu"), torch.float32)


def test_make_current_sets_numbered_gpus_only(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "set_device", calls.append)
    for device in ("cuda:1", torch.device("cuda", 0), "cuda", "cpu"):
        make_current(device)
    assert calls == [torch.device("cuda", 1), torch.device("cuda", 0)]


def test_the_engine_binds_its_device_on_the_loading_thread_and_the_engine_thread(tiny_checkpoint, monkeypatch):
    """CUDA's current device is per thread: the engine's loading thread and its zipmoe-engine thread
    each make the engine's device current (Triton kernels and graph capture follow it, not the tensors)."""
    bound, seen = [], threading.Event()

    def record(device):
        bound.append((threading.current_thread().name, torch.device(device)))
        seen.set()

    monkeypatch.setattr(engine_module, "make_current", record)
    monkeypatch.setattr(decoder_module, "make_current", record)
    engine = LLMEngine(tiny_checkpoint, EngineConfig(device="cpu", num_kv_blocks=64, max_model_len=256,
                                                     max_num_batched_tokens=256))
    assert bound == [(threading.current_thread().name, torch.device("cpu"))]
    seen.clear()
    service = DecoderService(engine, TokenBytes.from_tokenizer_json(tiny_checkpoint))
    try:
        assert seen.wait(30) and bound[-1] == ("zipmoe-engine", torch.device("cpu"))
    finally:
        service.shutdown()


class FakeGPUs:
    """torch.cuda's memory queries over two GPUs. GPU 0 is nearly full (another instance's engine) and
    current, as a new thread's current device is; this process's model and weights are on GPU 1."""

    def __init__(self, current: int = 0):
        self.allocated = {0: 0, 1: 62 * GIB}
        self.free = {0: 10 * GIB, 1: 70 * GIB}
        self.peak = dict(self.allocated)
        self.current, self.asked = current, []

    def _index(self, device) -> int:
        index = device if isinstance(device, int) else torch.device(device).index
        assert index is not None, "a query without a GPU number measures whichever GPU is current"
        self.asked.append(index)
        return index

    def install(self, monkeypatch) -> None:
        def reset_peak(device):
            self.peak[self._index(device)] = self.allocated[self._index(device)]

        fakes = {"memory_allocated": lambda device: self.allocated[self._index(device)],
                 "max_memory_allocated": lambda device: self.peak[self._index(device)],
                 "reset_peak_memory_stats": reset_peak, "synchronize": self._index,
                 "mem_get_info": lambda device: (self.free[self._index(device)], 140 * GIB),
                 "empty_cache": lambda: None, "current_device": lambda: self.current}
        for name, fake in fakes.items():
            monkeypatch.setattr(torch.cuda, name, fake)
        monkeypatch.setattr(memory, "worst_case_inputs", lambda model, *inputs: (None, None, None, None))


class FakeModel:
    def __init__(self, gpus: FakeGPUs, device: torch.device):
        self.gpus, self.device = gpus, device

    def forward(self, *step):  # the worst-case step's activations, on the model's GPU
        index = self.device.index if self.device.index is not None else self.gpus.current
        self.gpus.peak[index] = self.gpus.allocated[index] + 6 * GIB


@pytest.mark.parametrize("device, current", [(torch.device("cuda", 1), 0), (torch.device("cuda"), 1)])
def test_the_memory_plan_measures_the_instance_gpu(monkeypatch, device, current):
    """cuda:1 with GPU 0 current, or a bare cuda with GPU 1 current: every figure is GPU 1's."""
    gpus = FakeGPUs(current)
    gpus.install(monkeypatch)
    plan = memory.plan(FakeModel(gpus, device), None, 0.9, 8192, 4096, 64, 16, 3)
    assert plan == memory.MemoryPlan(total=140 * GIB, weights=62 * GIB, activations=6 * GIB, free=70 * GIB,
                                     utilization=0.9, device="cuda:1")
    assert set(gpus.asked) == {1} and plan.describe().startswith("cuda:1 140.0 GiB x 0.9")
    # With prefill graphs a second step, of their size, bounds their pool (the fake's peak: 6 GiB again).
    assert memory.plan(FakeModel(gpus, device), None, 0.9, 8192, 4096, 64, 16, 3, 2048).graphs == 6 * GIB
