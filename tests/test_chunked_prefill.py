"""Chunked prefill: a prompt computed over several steps (chunk boundaries inside image-token runs,
DeepStack rows and mRoPE positions spliced per chunk) gives the logits of a one-shot prefill, and
a sequence that decodes beside someone else's chunks gets the tokens it gets alone; such steps run
as piecewise graphs, or with each prompt token a row of a decode step (runner.prompt_rows), give what
they give eagerly. Under a per-token routing policy (truncate) the decode rows of such steps re-route
as in a decode step, on every path."""
from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

from zipmoe.engine.engine import EngineConfig, LLMEngine
from zipmoe.engine.multimodal import VisualInputs
from zipmoe.engine.prefill_graphs import PrefillGraphs, prefill_buckets
from zipmoe.engine.routing import RoutingPolicy, TruncatePolicy
from zipmoe.engine.runner import decode_row, is_decode
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


def engine(checkpoint, budget: int, device: str = "cpu", max_num_seqs: int = 4, prompt_graph_rows: int = 0,
           policy: str = "topk", **cfg) -> LLMEngine:
    """float32 on either device: chunks take other attention kernels than one shot, bf16 would blur them.
    policy: "topk", or "truncate" (every decode token keeps its first expert of the tiny model's 4)."""
    eng = LLMEngine(checkpoint, EngineConfig(device=device, dtype="float32", num_kv_blocks=64, block_size=4,
                                             max_model_len=256, max_num_seqs=max_num_seqs,
                                             max_num_batched_tokens=budget, prompt_graph_rows=prompt_graph_rows,
                                             **cfg))
    eng.set_routing_policy(TruncatePolicy(k=1) if policy == "truncate" else RoutingPolicy())
    return eng


POLICIES = ["topk", "truncate"]


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


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("device", DEVICES)
def test_decoding_beside_chunks_changes_no_token(tiny_checkpoint, request_with_images, device, policy):
    """Also under truncation: a decode row beside someone's prompt chunks keeps one expert, as alone."""
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

    alone, _ = run(engine(tiny_checkpoint, 256, device, policy=policy), with_images=False)
    _, b_alone = run(engine(tiny_checkpoint, 256, device, policy=policy), with_images=True)
    # b's prompt takes many steps, each with a's decode token in it
    eng = engine(tiny_checkpoint, 9, device, policy=policy)
    a_mixed, b_mixed = run(eng, with_images=True)
    assert a_mixed == alone and b_mixed == b_alone
    assert eng.runner.decode_rows_beside_prompts >= 3  # a's tokens beside b's chunks, counted
    if policy == "truncate":  # (the truncation changes tokens: the test can tell where it was skipped)
        assert alone != run(engine(tiny_checkpoint, 256, device), with_images=False)[0]


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


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("budget", [12, 33])
def test_prefill_pieces_give_the_eager_tokens(tiny_checkpoint, request_with_images, device, budget, policy):
    """Steps with prompt chunks run as pieces (prefill_graphs.py: CUDA graphs on CUDA, the same pieces
    eagerly on the CPU) on padded static buffers: a text stream decoding beside an image prompt's
    chunks (image rows, DeepStack rows, chunks that start mid-sequence), then beside a text prompt in
    the rows the image's DeepStack features used, gets the plain eager steps' logits, K/V and tokens.
    Buckets of 16, 32 and 40 rows: 12-token steps all pad to 16, 33-token steps take turns. Truncation:
    the pieces re-route the stream's decode rows as the eager step does."""
    ids, visual = request_with_images

    def run(pieces: bool):
        eng = engine(tiny_checkpoint, budget, device, policy=policy)
        eng.runner.prompt_row_context = 0  # no step rides a decode graph instead (runner.prompt_rows)
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


def admit_beside_a_stream(eng: LLMEngine, prompts: list) -> list[list[int]]:
    """A text stream decodes; each prompt (ids, or (ids, visual inputs)) then arrives, is prefilled beside
    it (in chunks where the budget is small) and generates a few tokens. The output ids of the stream and
    of each request."""
    a = eng.add_request(list(range(10, 30)), SamplingParams(max_tokens=30, ignore_eos=True))
    for _ in range(3):
        eng.step()
    seqs = [a]
    for prompt in prompts:
        ids, visual = prompt if isinstance(prompt, tuple) else (prompt, None)
        seqs.append(eng.add_request(ids, SamplingParams(max_tokens=4, ignore_eos=True), visual=visual))
        while not seqs[-1].output_ids:
            eng.step()
    while eng.has_work:
        eng.step()
    return [s.output_ids for s in seqs]


PROMPTS = [list(range(40, 53)), [7, 8, 9]]


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("device", DEVICES)
def test_prompt_rows_give_the_mixed_steps_logits(tiny_checkpoint, request_with_images, device, policy):
    """Each step with text prompt chunks (chunks that start mid-prompt, beside a decoding stream's token or
    not, and the text after an image request's images, at its mRoPE positions), computed as decode rows,
    one per prompt token over its own sequence's cache, gives the mixed step's logits in every row (the
    runner's eager decode forward on the same rows here). Prompt rows opt out of re-routing; under
    truncation the stream's decode row does not."""
    eng = engine(tiny_checkpoint, 8, device, max_num_seqs=8, policy=policy)
    runner, compared, after_images, decoding = eng.runner, [], [], []
    run = runner.run

    def text_only(batch):
        return not any(seq.visual is not None and any(seq.num_cached <= r < seq.num_cached + n for r in seq.image_rows)
                       for seq, n in batch)

    def both(batch):
        if not all(is_decode(seq, n) for seq, n in batch) and text_only(batch):
            after_images.append(any(seq.visual is not None and not is_decode(seq, n) for seq, n in batch))
            # The rows first: their attention reads only what their own slots got (the mixed step after
            # it writes the same K/V again).
            tensors, rows = runner.prompt_rows(batch)
            routed = [policy == "truncate" and decode_row(seq, n) for seq, n in batch for _ in range(n)]
            assert tensors["opt_out"].tolist() == [not r for r in routed]
            decoding.append(any(routed))
            ids, step, all_rows = runner.prepare_decode(tensors)
            got = eng.model.forward(ids, step, runner.kv, all_rows).logits
            ids, step, sampling = runner.prepare_mixed(batch)
            assert rows == sampling.tolist() and torch.equal(tensors["slots"].to(step.slots), step.slots)
            want = eng.model.forward(ids, step, runner.kv, torch.arange(ids.shape[0], device=ids.device)).logits
            compared.append((got, want))
        return run(batch)

    runner.run = both
    ids, visual = request_with_images
    admit_beside_a_stream(eng, PROMPTS + [(ids, copy.copy(visual))])
    # The stream's prompt in chunks of 8, 8 and 4, the next prompt's 7 and 6 beside its token, the last one's
    # 3; then the image request's chunks, those after its last image token compared.
    assert len(compared) > 6 and after_images[:6] == [False] * 6 and any(after_images)
    assert any(decoding) == (policy == "truncate")
    # On CUDA each text step fits the graphs' 8 rows and rides them (image chunks: piecewise graphs).
    assert runner.prompt_steps["decode_graph"][0] == (0 if device == "cpu" else len(compared))
    tol = 1e-5 if device == "cpu" else 1e-4
    for got, want in compared:
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)


def test_only_text_chunks_with_little_context_ride_a_decode_graph(tiny_checkpoint, request_with_images):
    ids, visual = request_with_images
    eng = engine(tiny_checkpoint, 256)
    runner = eng.runner
    runner.graphs = SimpleNamespace(max_rows=8)  # the decision only: a CPU engine has no graphs
    image = eng.add_request(ids, SamplingParams(max_tokens=4), visual=visual)
    text = eng.add_request(list(range(10, 15)), SamplingParams(max_tokens=4))
    first_image_row = image.image_rows[0]
    assert runner.rides_decode_graph([(text, 5)])
    assert not runner.rides_decode_graph([(image, first_image_row + 1)])  # an image token in the chunk
    image.num_cached = image.image_rows[-1] + 1  # the text after the images
    assert runner.rides_decode_graph([(image, 1), (text, 5)])
    assert not runner.rides_decode_graph([(image, 4), (text, 5)])  # 9 rows, the graphs hold 8
    runner.prompt_row_context = image.num_cached + 1 + 5 * 6 // 2
    assert runner.rides_decode_graph([(image, 1), (text, 5)])  # contexts: num_cached + 1, then 1 + ... + 5
    runner.prompt_row_context -= 1
    assert not runner.rides_decode_graph([(image, 1), (text, 5)])


@pytest.mark.gpu
def test_prompts_riding_the_decode_graphs_give_the_eager_tokens(tiny_checkpoint):
    """On CUDA the short prompts' steps replay a decode graph (prompt_rows), counted here, and every
    sequence gets the tokens of the same engine without that path (piecewise graphs, then eager)."""
    def run(rows: bool):
        eng = engine(tiny_checkpoint, 8, "cuda", max_num_seqs=8)
        if not rows:
            eng.runner.prompt_row_context = 0
        rode, prompt_rows = [], eng.runner.prompt_rows
        eng.runner.prompt_rows = lambda batch: rode.append(batch) or prompt_rows(batch)
        return admit_beside_a_stream(eng, PROMPTS), len(rode), eng.routing_stats.snapshot()

    (plain, none, plain_stats), (riding, rode, riding_stats) = run(rows=False), run(rows=True)
    assert none == 0 and rode == 6
    assert riding == plain
    assert riding_stats == plain_stats  # the decode steps' routing only: no prompt row counted


@pytest.mark.gpu
def test_prompts_above_the_decode_buckets_ride_graphs_of_their_own(tiny_checkpoint):
    """max_num_seqs 4, prompt_graph_rows 32: the stream's 20-token prompt, then three requests admitted
    together beside it (26 rows) replay the 32-row graph, and a fourth request after them (6 rows) the
    8-row graph. These graphs compute logits only for the rows that end a sequence (the 8-row step's
    after the 32-row step's four: none may name a row past its bucket); those rows give the mixed
    step's logits, and every sequence gets the tokens of an engine without such graphs."""
    prompts = [list(range(40, 53)), [7, 8, 9], list(range(60, 69))]

    def run(rows: int):
        # Steps one at a time: the three are admitted in a step that runner.run takes.
        eng = engine(tiny_checkpoint, 32, "cuda", max_num_seqs=4, prompt_graph_rows=rows, async_scheduling=False)
        runner, compared, run_step = eng.runner, [], eng.runner.run

        def both(batch):
            if runner.rides_decode_graph(batch) and sum(n for _, n in batch) > runner.graphs.max_batch:
                tensors, sampling = runner.prompt_rows(batch)
                got = runner._decode(tensors, counted=0, rows=sampling).clone()  # the next replay rewrites it
                ids, step, want_rows = runner.prepare_mixed(batch)
                compared.append((got, eng.model.forward(ids, step, runner.kv, want_rows).logits))
            return run_step(batch)

        runner.run = both
        stream = eng.add_request(list(range(10, 30)), SamplingParams(max_tokens=30, ignore_eos=True))
        for _ in range(3):
            eng.step()
        three = [eng.add_request(p, SamplingParams(max_tokens=4, ignore_eos=True)) for p in prompts]
        while not all(s.finished for s in three):
            eng.step()
        last = eng.add_request(list(range(80, 85)), SamplingParams(max_tokens=4, ignore_eos=True))
        while eng.has_work:
            eng.step()
        return [s.output_ids for s in [stream, *three, last]], compared, runner

    (plain, none, plain_runner), (riding, compared, runner) = run(0), run(32)
    assert plain_runner.graphs.buckets == [1, 2, 4] and none == []
    assert runner.graphs.buckets == [1, 2, 4, 8, 16, 32]
    # The rows that sample: the stream's last; its own and the three prompts' last; its own and the fourth's.
    assert [got.shape[0] for got, _ in compared] == [1, 4, 2]
    for got, want in compared:
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert riding == plain


def test_decode_graphs_read_the_sampled_rows_through_the_device_buffer():
    """DecodeGraphs.run without CUDA (its replays stubbed): the rows that sample reach the logit-row
    buffer by a queued copy, every entry written (unused ones name row 0), and are read from the
    bucket's logits through it in a decode bucket; a prompt-row bucket's graph gathers them itself."""
    from zipmoe.engine.cuda_graphs import DecodeGraphs
    from zipmoe.engine.model import StepOutput

    g = DecodeGraphs.__new__(DecodeGraphs)
    g.buckets, g.max_batch, g.scratch_slot, n = [1, 2, 4, 8], 4, 99, 8
    g.input_ids, g.slots = torch.zeros(n, dtype=torch.long), torch.zeros(n, dtype=torch.long)
    g.positions = torch.zeros(3, n, dtype=torch.long)
    g.block_tables, g.context_lens = torch.zeros(n, 2, dtype=torch.int32), torch.zeros(n, dtype=torch.int32)
    g.opt_out, g.logit_rows = torch.zeros(n, dtype=torch.bool), torch.full((4,), 7, dtype=torch.long)
    every_row = torch.arange(n * 3, dtype=torch.float).view(n, 3)  # what a bucket's forward computes
    g.outputs = {b: StepOutput(torch.zeros(b if b <= 4 else 4, 3), []) for b in g.buckets}

    def replay(b):
        if b <= g.max_batch:
            g.outputs[b].logits.copy_(every_row[:b])
        else:  # the prompt-row graph: logits of the rows the buffer names
            g.outputs[b].logits.copy_(every_row[g.logit_rows])

    g.graphs = {b: SimpleNamespace(replay=lambda b=b: replay(b)) for b in g.buckets}

    def run(B, rows):
        host = dict(input_ids=torch.arange(B), positions=torch.zeros(3, B, dtype=torch.long),
                    slots=torch.arange(B), block_tables=torch.zeros(B, 2, dtype=torch.int32),
                    context_lens=torch.ones(B, dtype=torch.int32), opt_out=torch.ones(B, dtype=torch.bool))
        return g.run(**host, logit_rows=rows).logits

    assert torch.equal(run(7, [2, 6]), every_row[[2, 6]])  # the 8-row prompt-row bucket
    assert g.logit_rows.tolist() == [2, 6, 0, 0]
    assert torch.equal(run(3, [2]), every_row[[2]])  # a decode bucket, one row sampling
    assert g.logit_rows.tolist() == [2, 0, 0, 0]
    assert torch.equal(run(3, None), every_row[:3])
