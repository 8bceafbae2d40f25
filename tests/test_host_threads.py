"""limit_host_threads: a GPU model's stub keeps one torch host thread unless OMP_NUM_THREADS says
otherwise; a CPU model keeps torch's default (its math runs there)."""
from __future__ import annotations

import pytest
import torch

from zipmoe.models.io import limit_host_threads


@pytest.fixture
def threads(monkeypatch):
    before = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    yield monkeypatch
    torch.set_num_threads(before)


def test_a_gpu_model_keeps_one_host_thread(threads):
    torch.set_num_threads(2)
    assert limit_host_threads(torch.device("cuda", 0)) == 1 == torch.get_num_threads()


def test_omp_num_threads_overrides(threads):
    torch.set_num_threads(2)
    threads.setenv("OMP_NUM_THREADS", "2")
    assert limit_host_threads(torch.device("cuda", 0)) == 2


def test_a_cpu_model_keeps_torch_default(threads):
    torch.set_num_threads(2)
    assert limit_host_threads(torch.device("cpu")) == 2
