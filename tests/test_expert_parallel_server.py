"""Expert parallel through a real tritonserver on the CPU: moe_decoder with expert_parallel_size 2
starts a second engine process (gloo), answers both pipelines as one process does, and ends it
when the server stops."""
from __future__ import annotations

import pytest

from test_data_parallel_server import REQUESTS, answer
from conftest import tiny_server

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def expert_parallel_server(tiny_checkpoint, tmp_path_factory):
    with tiny_server(tiny_checkpoint, tmp_path_factory, "expert_parallel",
                     {"moe_decoder": {"expert_parallel_size": "2"}}) as s:
        yield s


@pytest.mark.parametrize("model", ["mm_qa", "mm_qa_bls"])
def test_two_expert_processes_answer_as_one(expert_parallel_server, zipmoe_server, model):
    server = expert_parallel_server
    assert "experts split over 2 process(es)" in server.log_path.read_text()
    assert [answer(server, model, r) for r in REQUESTS] == [answer(zipmoe_server, model, r) for r in REQUESTS]
