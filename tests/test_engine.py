"""Scheduler, KV-block accounting, sampling and request checks of the engine (CPU)."""
from __future__ import annotations

import pytest

from zipmoe.engine.engine import EngineConfig, LLMEngine, RequestError
from zipmoe.engine.kv_cache import BlockManager
from zipmoe.engine.sequence import FinishReason, SamplingParams, Sequence

PROMPT = list(range(10, 40))


def engine(checkpoint, **cfg) -> LLMEngine:
    # One step at a time: these tests read which sequences each step() ran (test_async_scheduling.py
    # shows the pipelined engine gives the same tokens).
    base = dict(num_kv_blocks=64, block_size=16, max_model_len=512, max_num_batched_tokens=512, async_scheduling=False)
    return LLMEngine(checkpoint, EngineConfig(**{**base, **cfg}))


def drain(eng: LLMEngine) -> None:
    while eng.has_work:
        eng.step()


def greedy(n=12):
    return SamplingParams(max_tokens=n, ignore_eos=True)


def test_block_manager_accounting():
    bm = BlockManager(num_blocks=4, block_size=4)
    seq = Sequence(0, [1] * 5, greedy())
    assert bm.can_hold(seq, len(seq))
    bm.hold(seq, len(seq))
    assert len(seq.block_table) == 2 and bm.num_free == 2
    assert bm.slots(seq, 3, 6) == [seq.block_table[0] * 4 + 3, seq.block_table[1] * 4, seq.block_table[1] * 4 + 1]
    seq.output_ids += [7, 7, 7, 7]  # 9 tokens: position 8 needs a third block
    assert bm.can_hold(seq, len(seq)) and not bm.can_hold(seq, 17)
    bm.hold(seq, len(seq))
    assert len(seq.block_table) == 3 and bm.num_free == 1
    bm.hold(seq, len(seq))  # still room: no new block
    assert bm.num_free == 1
    bm.free(seq)
    assert bm.num_free == 4 and seq.block_table == []


def test_blocks_are_returned_when_requests_finish(tiny_checkpoint):
    eng = engine(tiny_checkpoint)
    seqs = [eng.add_request(PROMPT, greedy(20)) for _ in range(3)]
    eng.step()
    assert eng.blocks.num_free == 64 - 3 * 2
    drain(eng)
    assert eng.blocks.num_free == 64
    assert all(s.finish_reason is FinishReason.LENGTH and len(s.output_ids) == 20 for s in seqs)


def test_abort_frees_blocks_at_once(tiny_checkpoint):
    eng = engine(tiny_checkpoint)
    a = eng.add_request(PROMPT, greedy(50))
    b = eng.add_request(PROMPT, greedy(5))
    eng.step()
    eng.step()
    eng.abort(a)
    assert a.finish_reason is FinishReason.CANCELLED and a.block_table == []
    assert eng.blocks.num_free == 64 - len(b.block_table)
    drain(eng)
    assert len(b.output_ids) == 5 and eng.blocks.num_free == 64


def test_request_joins_running_batch_next_step(tiny_checkpoint):
    eng = engine(tiny_checkpoint)
    a = eng.add_request(PROMPT, greedy(30))
    for _ in range(5):
        eng.step()
    b = eng.add_request(PROMPT[:20], greedy(5))
    ran = [s for s, _ in eng.step()]
    assert ran == [a, b]  # the newcomer's prefill rides along with the running sequence's decode token
    ran = [s for s, _ in eng.step()]
    assert ran == [a, b]  # then both decode in one batch
    drain(eng)
    assert len(a.output_ids) == 30 and len(b.output_ids) == 5


def test_admission_waits_for_blocks_and_preemption_recomputes(tiny_checkpoint):
    """With too few blocks, sequences wait or get preempted, and still produce the same tokens."""
    prompts = [PROMPT, PROMPT[5:], PROMPT[::-1]]
    roomy = engine(tiny_checkpoint)
    want = [roomy.add_request(p, greedy(40)) for p in prompts]
    drain(roomy)
    tight = engine(tiny_checkpoint, num_kv_blocks=8, block_size=16, max_model_len=128, max_num_batched_tokens=128)
    got = [tight.add_request(p, greedy(40)) for p in prompts]
    drain(tight)
    assert tight.scheduler.num_preemptions > 0
    assert [s.output_ids for s in got] == [s.output_ids for s in want]
    assert tight.blocks.num_free == 8


def test_token_budget_chunks_prefill(tiny_checkpoint):
    eng = engine(tiny_checkpoint, max_model_len=64, max_num_batched_tokens=64)
    seqs = [eng.add_request(PROMPT, greedy(3)) for _ in range(3)]  # 30 tokens each
    assert eng.scheduler.schedule() == [(seqs[0], 30), (seqs[1], 30), (seqs[2], 4)]


def test_seeded_sampling_is_reproducible(tiny_checkpoint):
    eng = engine(tiny_checkpoint)
    params = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, top_k=50, seed=1234, ignore_eos=True)
    a, b = eng.add_request(PROMPT, params), eng.add_request(PROMPT, params)
    c = eng.add_request(PROMPT, SamplingParams(**{**params.__dict__, "seed": 99}))
    drain(eng)
    assert a.output_ids == b.output_ids != c.output_ids


def test_top_k_1_is_greedy(tiny_checkpoint):
    eng = engine(tiny_checkpoint)
    g = eng.add_request(PROMPT, greedy(16))
    k1 = eng.add_request(PROMPT, SamplingParams(max_tokens=16, temperature=0.8, top_k=1, seed=3, ignore_eos=True))
    p0 = eng.add_request(PROMPT, SamplingParams(max_tokens=16, temperature=0.8, top_p=1e-6, seed=3, ignore_eos=True))
    drain(eng)
    assert g.output_ids == k1.output_ids == p0.output_ids


@pytest.mark.parametrize("prompt, params, message", [
    ([], greedy(), "empty"),
    (list(range(600)), greedy(), "context holds max_model_len 512.*ask with a shorter question"),
    ([10**6], greedy(), "outside the vocabulary"),
    (PROMPT, SamplingParams(max_tokens=0), "max_tokens"),
    (PROMPT, SamplingParams(max_tokens=10**6), "max_tokens"),
    (PROMPT, SamplingParams(temperature=-1.0), "temperature"),
    (PROMPT, SamplingParams(temperature=float("inf")), "temperature must be a finite number"),
    (PROMPT, SamplingParams(temperature=float("nan")), "temperature must be a finite number"),
    (PROMPT, SamplingParams(top_p=0.0), "top_p"),
    (PROMPT, SamplingParams(top_k=-2), "top_k"),
])
def test_bad_requests_are_refused(tiny_checkpoint, prompt, params, message):
    eng = engine(tiny_checkpoint)
    with pytest.raises(RequestError, match=message):
        eng.add_request(prompt, params)
    assert not eng.has_work


def test_preempted_sequences_wait_until_they_fit():
    """The newest sequence is preempted when the oldest needs a block; it is not re-admitted in that
    pass, nor later while its blocks are not free again (no recompute step after step)."""
    from zipmoe.engine.scheduler import Scheduler

    blocks = BlockManager(num_blocks=10, block_size=4)
    sched = Scheduler(blocks, max_num_seqs=4, max_num_batched_tokens=8)
    old, new = Sequence(0, [1] * 27, greedy(40)), Sequence(1, [2] * 10, greedy(40))
    sched.add(old)

    def step():
        batch = sched.schedule()
        for seq, n in batch:
            seq.num_cached += n
            if seq.num_cached == len(seq):
                seq.output_ids.append(5)
        return batch

    while not old.output_ids:  # its prompt, chunk by chunk: 7 of the 10 blocks
        step()
    sched.add(new)
    assert step() == [(old, 1), (new, 7)]  # new fits to its end in the 3 free blocks
    batches = [step() for _ in range(12)]
    assert sched.num_preemptions == 1 and list(sched.waiting) == [new] and new.block_table == []
    first = next(i for i, b in enumerate(batches) if b == [(old, 1)])
    assert all(b == [(old, 1)] for b in batches[first:])  # from the preemption on: old alone


@pytest.mark.parametrize("cap, admitted_per_step", [(1, [1, 1, 1]), (2, [2, 1]), (0, [3])])
def test_new_sequences_beside_running_ones_are_capped_per_step(cap, admitted_per_step):
    """max_new_seqs_per_step bounds admissions into a step that carries running sequences' tokens;
    a step with nothing running admits all that fit; 0 lifts the cap."""
    from zipmoe.engine.scheduler import Scheduler

    sched = Scheduler(BlockManager(num_blocks=64, block_size=4), max_num_seqs=8, max_num_batched_tokens=64,
                      max_new_seqs_per_step=cap)
    streams = [Sequence(i, [1] * 5, greedy()) for i in range(2)]
    for seq in streams:
        sched.add(seq)
    assert sched.schedule() == [(seq, 5) for seq in streams]  # nothing was running: no cap
    for seq in streams:
        seq.num_cached, seq.output_ids = 5, [9]
    new = [Sequence(2 + i, [2] * 3, greedy()) for i in range(3)]
    for seq in new:
        sched.add(seq)
    counts = []
    while sched.waiting:
        batch, running = sched.schedule(), len(streams)
        assert batch[:running] == [(seq, 1) for seq in streams]  # the running streams' tokens, every step
        counts.append(len(batch) - running)
        for seq, n in batch[running:]:
            seq.num_cached, seq.output_ids = n, [9]
        streams += [seq for seq, _ in batch[running:]]
        for seq in streams:
            seq.num_cached = len(seq) - 1
    assert counts == admitted_per_step


def test_decode_batch_tensors_follow_the_block_tables():
    """The decode step's host tensors, against their definition: the newest token's cache slot, the
    tables padded with block 0, positions shifted by each sequence's rope delta."""
    from zipmoe.engine.runner import ModelRunner

    blocks = BlockManager(num_blocks=64, block_size=4)
    seqs = []
    for i, n in enumerate((3, 9, 17)):
        seq = Sequence(i, list(range(1, n + 1)), greedy(8), opt_out=i == 1)
        blocks.hold(seq, n + 1)
        seq.num_cached, seq.output_ids = n, [7 + i]
        seqs.append(seq)
    blocks.free(seqs[0])
    blocks.hold(seqs[0], 4)  # a table rebuilt after a free
    seqs[0].num_cached = 3
    runner = ModelRunner.__new__(ModelRunner)
    runner.blocks = blocks
    d = runner.decode_batch(seqs)
    width = max(len(s.block_table) for s in seqs)
    assert d["block_tables"].tolist() == [s.block_table + [0] * (width - len(s.block_table)) for s in seqs]
    assert d["slots"].tolist() == [s.block_table[(len(s) - 1) // 4] * 4 + (len(s) - 1) % 4 for s in seqs]
    assert d["context_lens"].tolist() == [len(s) for s in seqs] and d["input_ids"].tolist() == [7, 8, 9]
    assert d["positions"].tolist() == [[len(s) - 1 for s in seqs]] * 3
    assert d["opt_out"].tolist() == [False, True, False]
