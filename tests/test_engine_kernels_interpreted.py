"""The engine with its Triton kernels, run in Triton's interpreter on the CPU, against its PyTorch
reference ops: a mixed load of image requests (kept tokens at keep 0.4 / 0.6 / 1.0) whose prompts
are prefilled in chunks beside decoding sequences, with a preemption, gives the same tokens. It
guards the kernels' logic on the steps the server makes under load, a lone decode token's folded
router included (on a GPU the same comparison is test_engine_cuda's)."""
from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

from zipmoe.engine import model
from zipmoe.engine.engine import EngineConfig, LLMEngine
from zipmoe.engine.sequence import SamplingParams
from zipmoe.prompt import ChatPrompt
from zipmoe.vision import VisionEncoder

from test_vision_reference import SIZES, visual_request


def serve(checkpoint, requests, kernels: bool, folded: list | None = None, **routing):
    """(each request's tokens, preemptions); folded: gets a None for each `folded_moe` call; routing:
    EngineConfig's routing settings."""
    eng = LLMEngine(checkpoint, EngineConfig(device="cpu", dtype="float32", num_kv_blocks=18, block_size=4,
                                             max_model_len=72, max_num_batched_tokens=48, max_num_seqs=4,
                                             **routing))
    if kernels:
        def counted(*args):
            folded.append(None)
            return model.KERNELS.folded_moe(*args)
        eng.model.ops = SimpleNamespace(**{**vars(model.KERNELS), "folded_moe": counted})
    seqs = [eng.add_request(list(ids), SamplingParams(max_tokens=12, ignore_eos=True), visual=copy.deepcopy(visual))
            for ids, visual in requests]
    while eng.has_work:
        eng.step()
    return [s.output_ids for s in seqs], eng.scheduler.num_preemptions


def test_kernels_give_the_reference_tokens_on_a_mixed_image_load(tiny_checkpoint):
    g = torch.Generator().manual_seed(1)
    encoder, chat = VisionEncoder(tiny_checkpoint, torch.device("cpu"), torch.float32), ChatPrompt(tiny_checkpoint)
    requests = [visual_request(encoder, chat, [torch.randn(3, h, w, generator=g) for h, w in SIZES[:1 + i % len(SIZES)]],
                               keep)[:2] for i, keep in enumerate((0.4, 0.6, 1.0))]
    reference, preempted = serve(tiny_checkpoint, requests, kernels=False)
    assert preempted > 0  # the load this test is about
    folded = []
    assert serve(tiny_checkpoint, requests, kernels=True, folded=folded) == (reference, preempted)
    assert folded  # steps with one decode token took the folded router


@pytest.mark.parametrize("routing", [dict(routing_policy="oea", oea_k0=2), dict(routing_policy="truncate"),
                                     dict(routing_policy="sere", sere_threshold=0.0)], ids=["oea", "truncate", "sere"])
def test_a_lone_token_under_a_policy_takes_the_folded_router(tiny_checkpoint, routing):
    """OEA and truncation leave a lone decode token its first 2 experts, SERE moves its later ones to
    its first 2 (`RoutingPolicy.one_token_route`; SERE with the checkpoint's tables, every unprotected
    slot moving): with the kernels that is `folded_moe`, and the tokens are the reference's (the
    router, then the policy)."""
    requests = [(list(range(3, 11)), None)]
    reference, _ = serve(tiny_checkpoint, requests, kernels=False, **routing)
    folded = []
    assert serve(tiny_checkpoint, requests, kernels=True, folded=folded, **routing)[0] == reference
    assert folded
