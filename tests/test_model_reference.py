"""Our text decoder against transformers' Qwen3VLMoeForConditionalGeneration on the tiny checkpoint."""
from __future__ import annotations

import pytest
import torch
from transformers import Qwen3VLMoeForConditionalGeneration

from zipmoe.engine.engine import EngineConfig, LLMEngine
from zipmoe.engine.model import StepInputs
from zipmoe.engine.sequence import SamplingParams
from zipmoe.kernels.layer_ops import rms_norm_reference
from zipmoe.prompt import ChatPrompt

QUESTIONS = ["What does the receipt say the total is?", "你好，这张图片里有什么？🙂", "Count the red shapes."]
STEPS = 32


@pytest.fixture(scope="module")
def reference(tiny_checkpoint):
    return Qwen3VLMoeForConditionalGeneration.from_pretrained(tiny_checkpoint, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompts(tiny_checkpoint):
    chat = ChatPrompt(tiny_checkpoint)
    return [chat.encode(q) for q in QUESTIONS]


def reference_greedy(model, ids, steps, device="cpu"):
    out = model.generate(torch.tensor([ids], device=device), max_new_tokens=steps, min_new_tokens=steps,
                         do_sample=False)
    return out[0, len(ids):].tolist()


def run_engine(checkpoint, prompts, steps, **cfg):
    engine = LLMEngine(checkpoint, EngineConfig(num_kv_blocks=64, max_model_len=256, max_num_batched_tokens=1024, **cfg))
    seqs = [engine.add_request(p, SamplingParams(max_tokens=steps, ignore_eos=True)) for p in prompts]
    while engine.has_work:
        engine.step()
    return engine, [s.output_ids for s in seqs]


def test_prefill_logits_match(tiny_checkpoint, reference, prompts):
    engine = LLMEngine(tiny_checkpoint, EngineConfig(num_kv_blocks=64, max_model_len=256))
    runner = engine.runner
    seq = engine.add_request(prompts[0], SamplingParams(max_tokens=1))
    batch = engine.scheduler.schedule()
    ids, step, _ = runner.prepare_mixed(batch)
    ours = engine.model.forward(ids, step, runner.kv, torch.arange(len(seq))).logits
    with torch.no_grad():
        ref = reference(input_ids=torch.tensor([prompts[0]])).logits[0]
    assert batch == [(seq, len(seq))]
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)


def test_greedy_tokens_match_for_32_steps(tiny_checkpoint, reference, prompts):
    _, ours = run_engine(tiny_checkpoint, prompts, STEPS)
    for ids, got in zip(prompts, ours):
        assert got == reference_greedy(reference, ids, STEPS)


def test_batched_equals_alone(tiny_checkpoint, prompts):
    """Decoding three sequences in one batch gives what each gives alone."""
    _, together = run_engine(tiny_checkpoint, prompts, STEPS)
    alone = [run_engine(tiny_checkpoint, [p], STEPS)[1][0] for p in prompts]
    assert together == alone


@pytest.mark.gpu
def test_cuda_engine_matches_reference(tiny_checkpoint, reference, prompts):
    _, fp32 = run_engine(tiny_checkpoint, prompts, STEPS, device="cuda", dtype="float32")
    for ids, got in zip(prompts, fp32):
        assert got == reference_greedy(reference, ids, STEPS)
    # bf16 on the GPU: logits drift, so check only that the first tokens agree.
    _, bf16 = run_engine(tiny_checkpoint, prompts, 4, device="cuda", dtype="bfloat16")
    assert sum(a[0] == b[0] for a, b in zip(bf16, fp32)) >= 2


def test_the_last_layer_norms_what_its_deepstack_features_leave(tiny_checkpoint):
    """A last layer with DeepStack features (a model whose visual features reach every layer) adds
    them, then takes the final norm: with features that change nothing, what the last layer
    without them returns; with features that set every row to ones, the final norm of ones."""
    engine = LLMEngine(tiny_checkpoint, EngineConfig(num_kv_blocks=64, max_model_len=256))
    model, kv = engine.model, engine.runner.kv
    g = torch.Generator().manual_seed(0)
    h = torch.randn(3, model.cfg.hidden_size, generator=g)
    attn = torch.randn(3, model.cfg.num_heads * model.cfg.head_dim, generator=g)
    step = StepInputs(positions=torch.zeros(3, 3, dtype=torch.long), slots=torch.zeros(3, dtype=torch.long),
                      is_prefill=True)
    last = model.layers[-1]

    def rest(inject):
        x, q = model.layer_rest(last, None, h, attn, None, None, step, kv, [], inject)
        assert q is None
        return x

    torch.testing.assert_close(rest(lambda x: x), rest(None))
    want = rms_norm_reference(torch.ones_like(h), model.norm, model.cfg.rms_norm_eps)
    torch.testing.assert_close(rest(lambda x: torch.ones_like(x)), want)
