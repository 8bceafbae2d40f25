"""Expert parallel through a real tritonserver on the CPU: moe_decoder with expert_parallel_size 2
starts a second engine process (gloo), answers both pipelines as one process does, and ends it
when the server stops."""
from __future__ import annotations

import pytest

from test_data_parallel_server import REQUESTS, answer
from zipmoe import serve

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def expert_parallel_server(tiny_checkpoint, tmp_path_factory):
    log = tmp_path_factory.mktemp("expert_parallel") / "server.log"
    ports = dict(http_port=serve.free_port(), grpc_port=serve.free_port(), metrics_port=serve.free_port())
    with serve.TritonServer(serve.DEFAULT_REPOSITORY, checkpoint=str(tiny_checkpoint), log_path=log,
                            overrides={"moe_decoder": {"expert_parallel_size": "2"}}, **ports) as s:
        s.wait_ready(timeout=300)
        yield s, log


@pytest.mark.parametrize("model", ["mm_qa", "mm_qa_bls"])
def test_two_expert_processes_answer_as_one(expert_parallel_server, zipmoe_server, model):
    server, log = expert_parallel_server
    assert "experts split over 2 process(es)" in log.read_text()
    assert [answer(server, model, r) for r in REQUESTS] == [answer(zipmoe_server, model, r) for r in REQUESTS]
