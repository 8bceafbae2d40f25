"""Chunked prefill: a prompt computed over several steps (chunk boundaries inside image-token runs,
DeepStack rows and mRoPE positions spliced per chunk) gives the logits of a one-shot prefill, and
a sequence that decodes beside someone else's chunks gets the tokens it gets alone; such steps run
as piecewise graphs give what they give eagerly."""
from __future__ import annotations

import copy

import pytest
import torch

from zipmoe.engine.engine import EngineConfig, LLMEngine
from zipmoe.engine.multimodal import VisualInputs
from zipmoe.engine.prefill_graphs import PrefillGraphs, prefill_buckets
from zipmoe.engine.sequence import SamplingParams
from zipmoe.prompt import ChatPrompt
from zipmoe.vision import VisionEncoder

from test_vision_reference import SIZES, visual_request


@pytest.fixture(scope="module")
def request_with_images(tiny_checkpoint):
    g = torch.Generator().manual_seed(1)
    images = [torch.randn(3, h, w, generator=g) for h, w in SIZES]
    encoder = VisionEncoder(tiny_checkpoint, torch.device("cpu"), torch.float32)
    ids, visual, _ = visual_request(encoder, ChatPrompt(tiny_checkpoint), images, 0.6)
    return ids, visual


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def engine(checkpoint, budget: int, device: str = "cpu") -> LLMEngine:
    """float32 on either device: chunks take other attention kernels than one shot, bf16 would blur them."""
    return LLMEngine(checkpoint, EngineConfig(device=device, dtype="float32", num_kv_blocks=64, block_size=4,
                                              max_model_len=256, max_num_seqs=4, max_num_batched_tokens=budget))


def prefill_logits(eng: LLMEngine, ids, visual) -> tuple[torch.Tensor, int]:
    """Runs the prompt's chunks step by step; the last row's logits and the number of steps."""
    seq = eng.add_request(ids, SamplingParams(max_tokens=1), visual=visual)
    steps = 0
    while seq.num_cached < len(seq):
        batch = eng.scheduler.schedule()
        inputs, step, rows = eng.runner.prepare_mixed(batch)
        logits = eng.model.forward(inputs, step, eng.runner.kv, rows).logits
        for s, n in batch:
            s.num_cached += n
        steps += 1
    return logits[-1], steps


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("budget", [4, 7, 33])
def test_chunked_prefill_gives_the_one_shot_logits(tiny_checkpoint, request_with_images, budget, device):
    ids, visual = request_with_images
    whole, one = prefill_logits(engine(tiny_checkpoint, 256, device), ids, visual)
    chunked, steps = prefill_logits(engine(tiny_checkpoint, budget, device), ids, visual)
    assert one == 1 and steps == -(-len(ids) // budget)
    tol = 1e-5 if device == "cpu" else 1e-4  # float32 GPU kernels sum in other orders
    torch.testing.assert_close(chunked, whole, rtol=tol, atol=tol)


@pytest.mark.parametrize("device", DEVICES)
def test_decoding_beside_chunks_changes_no_token(tiny_checkpoint, request_with_images, device):
    ids, visual = request_with_images
    text = list(range(10, 30))

    def run(eng, with_images: bool):
        a = eng.add_request(text, SamplingParams(max_tokens=24, ignore_eos=True))
        for _ in range(3):
            eng.step()
        b = eng.add_request(ids, SamplingParams(max_tokens=8, ignore_eos=True), visual=visual) if with_images else None
        while eng.has_work:
            eng.step()
        return a.output_ids, None if b is None else b.output_ids

    alone, _ = run(engine(tiny_checkpoint, 256, device), with_images=False)
    _, b_alone = run(engine(tiny_checkpoint, 256, device), with_images=True)
    eng = engine(tiny_checkpoint, 9, device)  # b's prompt takes many steps, each with a's decode token in it
    a_mixed, b_mixed = run(eng, with_images=True)
    assert a_mixed == alone and b_mixed == b_alone


@pytest.mark.parametrize("device", DEVICES)
def test_a_decoding_image_request_beside_chunks_reads_no_features(tiny_checkpoint, request_with_images, device,
                                                                  monkeypatch):
    """Once its prompt is cached a sequence's visual features leave the GPU (`VisualInputs.offload`); a
    step that decodes it beside another prompt's chunks must not touch them. Here offload moves them to
    the meta device, which no kernel can read (on an H200 the host copy once met a chunk's GPU
    features in one torch.cat: a device mismatch that failed every step with two image requests)."""
    ids, visual = request_with_images

    def to_meta(self):
        self.embeds = self.embeds.to("meta")
        self.deepstack = None if self.deepstack is None else self.deepstack.to("meta")

    def run(eng):
        first = eng.add_request(ids, SamplingParams(max_tokens=24, ignore_eos=True), visual=copy.copy(visual))
        while not first.output_ids:
            eng.step()
        second = eng.add_request(ids, SamplingParams(max_tokens=4, ignore_eos=True), visual=copy.copy(visual))
        while eng.has_work:
            eng.step()
        return first.output_ids, second.output_ids

    reference = run(engine(tiny_checkpoint, 256, device))
    monkeypatch.setattr(VisualInputs, "offload", to_meta)
    assert run(engine(tiny_checkpoint, 9, device)) == reference


def test_prefill_buckets():
    assert prefill_buckets(2048) == [16, 32, 64, 128, 256, 512, 768, 1024, 1280, 1536, 1792, 2048]
    assert prefill_buckets(600) == [16, 32, 64, 128, 256, 512, 600]
    assert prefill_buckets(9) == [9]


class Compared:
    """Stands in for the runner's PrefillGraphs: each step runs eagerly, its cache slots get back
    what they held before, then it runs as pieces, which must write the same K/V (their own
    attention reads it) and give the same logits. Keeps (tokens, the pieces' results, eager's)."""

    def __init__(self, graphs: PrefillGraphs, model, kv):
        self.graphs, self.model, self.kv = graphs, model, kv  # not the engine: no reference cycle
        self.max_tokens = graphs.max_tokens
        self.steps = []

    def _cache(self, slots):
        return torch.stack([torch.stack([k[slots], v[slots]]) for k, v in zip(self.kv.k, self.kv.v)])

    def forward(self, ids, step, rows):
        before = self._cache(step.slots)
        eager = self.model.forward(ids, step, self.kv, rows).logits, self._cache(step.slots)
        for (k, v), (k_before, v_before) in zip(zip(self.kv.k, self.kv.v), before):
            k[step.slots], v[step.slots] = k_before, v_before
        out = self.graphs.forward(ids, step, rows)
        self.steps.append((ids.shape[0], (out.logits.clone(), self._cache(step.slots)), eager))
        return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("budget", [12, 33])
def test_prefill_pieces_give_the_eager_tokens(tiny_checkpoint, request_with_images, device, budget):
    """Steps with prompt chunks run as pieces (prefill_graphs.py: CUDA graphs on CUDA, the same pieces
    eagerly on the CPU) on padded static buffers: a text stream decoding beside an image prompt's
    chunks (image rows, DeepStack rows, chunks that start mid-sequence), then beside a text prompt in
    the rows the image's DeepStack features used, gets the plain eager steps' logits, K/V and tokens.
    Buckets of 16, 32 and 40 rows: 12-token steps all pad to 16, 33-token steps take turns."""
    ids, visual = request_with_images

    def run(pieces: bool):
        eng = engine(tiny_checkpoint, budget, device)
        compared = None
        if pieces:
            graphs = PrefillGraphs(eng.model, eng.runner.kv, 40, capture=device == "cuda")
            eng.runner.prefill_graphs = compared = Compared(graphs, eng.model, eng.runner.kv)
        a = eng.add_request(list(range(10, 30)), SamplingParams(max_tokens=40, ignore_eos=True))
        for _ in range(3):
            eng.step()
        b = eng.add_request(ids, SamplingParams(max_tokens=6, ignore_eos=True), visual=copy.copy(visual))
        while not b.output_ids:
            eng.step()
        c = eng.add_request(list(range(40, 70)), SamplingParams(max_tokens=6, ignore_eos=True))
        while eng.has_work:
            eng.step()
        return [s.output_ids for s in (a, b, c)], compared

    eager, _ = run(pieces=False)
    replayed, compared = run(pieces=True)
    assert replayed == eager
    buckets = {next(b for b in compared.graphs.buckets if b >= tokens) for tokens, _, _ in compared.steps}
    assert len(compared.steps) >= 3 and len(buckets) == (1 if budget <= 16 else 3)
    tol = 1e-5 if device == "cpu" else 1e-4
    for _, got, want in compared.steps:
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)
