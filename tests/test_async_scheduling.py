"""Async scheduling (EngineConfig.async_scheduling): decode steps pipelined (sampled ones too, and
short prompts admitted into them), the next launched before this one's tokens are read back. The
caller sees the same tokens and endings as without it, however requests arrive, stop, are cancelled
or get preempted (also over random traffic); on CUDA with CUDA graphs as well (gpu)."""
from __future__ import annotations

import random

import pytest
import torch

from zipmoe.detokenize import TokenBytes
from zipmoe.engine.engine import EngineConfig, LLMEngine
from zipmoe.engine.sequence import SamplingParams
from zipmoe.serving.decode_request import DecodeRequest
from zipmoe.serving.decoder import DecoderService

from test_decoder_service import PROMPT, Sink

PROMPTS = {name: list(range(7 + 3 * i, 30 + 4 * i)) for i, name in enumerate(
    ["long", "short", "stops", "cancelled", "sampled", "trigger", "late", "eos"])}


def engine(checkpoint, pipelined: bool, device="cpu", **cfg) -> LLMEngine:
    base = dict(device=device, num_kv_blocks=64, block_size=16, max_model_len=256, max_num_batched_tokens=512,
                async_scheduling=pipelined)
    return LLMEngine(checkpoint, EngineConfig(**{**base, **cfg}))


def serve(eng: LLMEngine, with_sampled: bool = True) -> dict[str, tuple[list[int], str]]:
    """A caller that acts on the tokens it gets back: a stop string after 5 tokens, a cancel after 7,
    a request that arrives once another has 6 tokens."""
    params = {"long": SamplingParams(max_tokens=40, ignore_eos=True), "short": SamplingParams(max_tokens=3, ignore_eos=True),
              "stops": SamplingParams(max_tokens=30, ignore_eos=True),
              "cancelled": SamplingParams(max_tokens=30, ignore_eos=True),
              "sampled": SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True),
              "trigger": SamplingParams(max_tokens=20, ignore_eos=True),
              "late": SamplingParams(max_tokens=15, ignore_eos=True), "eos": SamplingParams(max_tokens=60)}
    first = [n for n in params if n != "late" and (with_sampled or n != "sampled")]
    seqs = {name: eng.add_request(PROMPTS[name], params[name]) for name in first}
    names = {id(seq): name for name, seq in seqs.items()}
    while eng.has_work:
        for seq, _ in eng.step():
            name, n = names[id(seq)], len(seq.output_ids)
            if name == "stops" and n == 5:
                eng.finish_stopped(seq)
            elif name == "cancelled" and n == 7:
                eng.abort(seq)
            elif name == "trigger" and n == 6:
                seqs["late"] = eng.add_request(PROMPTS["late"], params["late"])
                names[id(seqs["late"])] = "late"
    assert eng.blocks.num_free == eng.blocks.num_blocks and all(s.pending == 0 for s in seqs.values())
    return {name: (seq.output_ids, seq.finish_reason.value) for name, seq in seqs.items()}


def test_pipelined_steps_give_the_callers_tokens_and_endings(tiny_checkpoint):
    eos = serve(engine(tiny_checkpoint, False))["eos"][0][9]  # a token the random model emits: EOS from here on
    runs = []
    for pipelined in (False, True):
        eng = engine(tiny_checkpoint, pipelined)
        eng.eos = {eos}
        runs.append(serve(eng))
    plain, piped = runs
    assert piped == plain
    assert [len(plain[n][0]) for n in ("long", "short", "stops", "cancelled", "late")] == [40, 3, 5, 7, 15]
    assert plain["eos"][1] == "eos" and len(plain["eos"][0]) <= 10


def test_pipelined_steps_survive_preemption(tiny_checkpoint):
    tight = dict(num_kv_blocks=8, max_model_len=128, max_num_batched_tokens=128)
    plain_engine, piped_engine = engine(tiny_checkpoint, False, **tight), engine(tiny_checkpoint, True, **tight)
    plain = serve(plain_engine, with_sampled=False)
    assert serve(piped_engine, with_sampled=False) == plain
    assert piped_engine.scheduler.num_preemptions > 0


def test_a_decode_step_is_in_flight_when_the_previous_tokens_come_back(tiny_checkpoint):
    eng = engine(tiny_checkpoint, True)
    seqs = [eng.add_request(PROMPT, SamplingParams(max_tokens=6, ignore_eos=True)),
            eng.add_request(PROMPT, SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.7, seed=3))]
    assert [len(eng.step()) for _ in range(3)] == [2, 0, 2]  # prefill; decode launched; its tokens
    assert all(len(s.output_ids) == 2 and s.pending == 1 for s in seqs)  # the third is being computed
    while eng.has_work:
        eng.step()
    assert all(len(s.output_ids) == 6 and s.pending == 0 for s in seqs)


def test_steps_run_and_pipelined_are_counted(tiny_checkpoint):
    """One prefill step, then five decode steps for tokens 2..6: the first launched after a step that
    was read back, the other four behind the one in flight (zipmoe_engine_steps_pipelined_total)."""
    counted = {}
    for pipelined in (False, True):
        eng = engine(tiny_checkpoint, pipelined)
        for _ in range(2):
            eng.add_request(PROMPT, SamplingParams(max_tokens=6, ignore_eos=True))
        while eng.has_work:
            eng.step()
        counted[pipelined] = (eng.steps_run, eng.steps_pipelined)
    assert counted == {False: (6, 0), True: (6, 4)}


def test_the_decoder_service_streams_alike_with_async_scheduling(tiny_checkpoint):
    def stream(pipelined):
        svc = DecoderService(engine(tiny_checkpoint, pipelined), TokenBytes.from_tokenizer_json(tiny_checkpoint))
        try:
            sinks = [Sink(), Sink(cancel_after=4)]
            for sink, n in zip(sinks, (24, 200)):
                svc.submit(DecodeRequest(PROMPT, {"stream": True, "max_tokens": n, "ignore_eos": True}), sink)
            assert all(sink.done.wait(60) for sink in sinks)
            blocks = svc.engine.blocks
            assert blocks.num_free == blocks.num_blocks and svc.counts["requests_cancelled"] == 1
            return [r.output_ids.tolist() for r in sinks[0].responses], sinks[0].text(svc.token_bytes)
        finally:
            svc.shutdown()

    assert stream(True) == stream(False)


@pytest.mark.gpu
def test_pipelined_cuda_graph_steps_give_the_same_tokens(tiny_checkpoint):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    plain = serve(engine(tiny_checkpoint, False, device="cuda", dtype="float32"))
    assert serve(engine(tiny_checkpoint, True, device="cuda", dtype="float32")) == plain


@pytest.mark.gpu
def test_a_launch_behind_the_step_in_flight_never_waits_for_the_gpu(tiny_checkpoint):
    """Every launch behind the step in flight, a short prompt admitted into it included, runs under
    torch's sync debug mode "error": any host sync (a blocking copy, a read-back) in it raises."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    eng = engine(tiny_checkpoint, True, device="cuda", dtype="float32")
    launched, launch = [], eng.runner.launch

    def strict(batch, input_ids):
        torch.cuda.set_sync_debug_mode("error")
        try:
            return launch(batch, input_ids)
        finally:
            torch.cuda.set_sync_debug_mode("default")
            launched.append(input_ids is not None and len(batch) > input_ids.shape[0])

    eng.runner.launch = strict
    stream = eng.add_request(PROMPTS["long"], SamplingParams(max_tokens=20, ignore_eos=True))
    while len(stream.output_ids) < 3:
        eng.step()
    eng.add_request(PROMPTS["short"], SamplingParams(max_tokens=4, ignore_eos=True))
    while eng.has_work:
        eng.step()
    assert any(launched)  # the short prompt went in behind the step in flight


@pytest.mark.gpu
def test_routing_sums_read_without_waiting_are_exact_for_every_token_read(tiny_checkpoint):
    """snapshot(wait=False) between pipelined steps: exactly the sums as of the step whose tokens were
    just read (those the next launch started from), never waiting for the step in flight."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    eng = engine(tiny_checkpoint, True, device="cuda", dtype="float32")
    for name in ("long", "short", "late"):
        eng.add_request(PROMPTS[name], SamplingParams(max_tokens=12, ignore_eos=True))
    stats, starts, launch = eng.routing_stats, [], eng.runner.launch

    def recorded(batch, input_ids):  # the sums each launch starts from (a queued device copy)
        starts.append(None if stats._sums is None else stats._sums.clone())
        return launch(batch, input_ids)

    eng.runner.launch = recorded
    checked = 0
    while eng.has_work:
        read = eng.step()  # launches the next step, then reads this one back
        if read and eng.step_in_flight and starts[-1] is not None:
            assert stats.snapshot(wait=False) == dict(zip(stats.FIELDS, starts[-1].tolist()))
            checked += 1
    assert checked >= 3 and stats.snapshot(wait=False) == stats.snapshot()  # every step read: exact


def count_follow_ups(eng: LLMEngine) -> list[bool]:
    """Records, for each decode step launched on the step before's tokens, whether a request was waiting."""
    seen, launch = [], eng.runner.launch

    def counted(batch, input_ids):
        if input_ids is not None:
            seen.append(bool(eng.scheduler.waiting))
        return launch(batch, input_ids)

    eng.runner.launch = counted
    return seen


def test_steps_keep_following_while_a_request_waits_for_a_seat(tiny_checkpoint):
    def run(pipelined):
        eng = engine(tiny_checkpoint, pipelined, max_num_seqs=2)
        follow_ups = count_follow_ups(eng)
        seqs = [eng.add_request(PROMPTS[n], SamplingParams(max_tokens=10 + 5 * i, ignore_eos=True))
                for i, n in enumerate(("long", "short", "late"))]
        while eng.has_work:
            eng.step()
        return [s.output_ids for s in seqs], follow_ups

    (plain, none), (piped, follow_ups) = run(False), run(True)
    assert piped == plain and not none
    assert any(follow_ups) and len(follow_ups) > 10  # pipelined while the third request had no seat


def test_a_context_that_reaches_max_model_len_ends_alike(tiny_checkpoint):
    def run(pipelined):
        eng = engine(tiny_checkpoint, pipelined, max_model_len=48)
        seqs = [eng.add_request(PROMPTS[n], SamplingParams(max_tokens=100, ignore_eos=True)) for n in ("long", "stops")]
        while eng.has_work:
            eng.step()
        return [(s.output_ids, s.finish_reason.value, len(s)) for s in seqs]

    plain = run(False)
    assert run(True) == plain and all(reason == "length" and n == 48 for _, reason, n in plain)


def test_turning_it_off_with_a_step_in_flight_then_prefilling(tiny_checkpoint):
    eng = engine(tiny_checkpoint, True)
    first = eng.add_request(PROMPT, SamplingParams(max_tokens=30, ignore_eos=True))
    while len(first.output_ids) < 4:
        eng.step()
    assert first.pending == 1
    eng.set_async_scheduling(False)
    eng.abort(first)
    later = eng.add_request(PROMPTS["late"], SamplingParams(max_tokens=8, ignore_eos=True))
    while eng.has_work:
        eng.step()
    alone = engine(tiny_checkpoint, False)
    again = alone.add_request(PROMPTS["late"], SamplingParams(max_tokens=8, ignore_eos=True))
    while alone.has_work:
        alone.step()
    assert later.output_ids == again.output_ids and first.pending == 0 and len(first.output_ids) == 4
    assert eng.blocks.num_free == eng.blocks.num_blocks


def test_short_prompts_are_admitted_behind_the_step_in_flight(tiny_checkpoint):
    """A whole text prompt that rides a decode graph beside the running streams is launched behind the
    step in flight (its rows after their decode tokens, whose ids stay on the device): the same tokens
    and endings as one step at a time. On a CPU no decode graph exists, so the test lets every step
    ride one (the eager decode forward computes the same rows)."""
    def run(pipelined):
        eng = engine(tiny_checkpoint, pipelined)
        eng.runner.rides_decode_graph = lambda batch: True
        return serve(eng), eng.runner.prompt_steps

    (plain, plain_steps), (piped, piped_steps) = run(False), run(True)
    assert piped == plain
    assert plain_steps["pipelined"][0] == 0 and piped_steps["pipelined"][0] == 1  # "late", beside the others
    assert piped_steps["decode_graph"][0] == plain_steps["decode_graph"][0] - 1


def test_a_sequence_ending_in_flight_does_not_stop_the_pipeline(tiny_checkpoint):
    """Two requests, 3 and 10 tokens: the step after the one carrying the short one's last token is
    still launched behind it, without that sequence; ten steps, tokens 3..10 launched behind the
    step before (the prefill and the first decode step are not)."""
    def run(pipelined):
        eng = engine(tiny_checkpoint, pipelined)
        seqs = [eng.add_request(PROMPTS[n], SamplingParams(max_tokens=m, ignore_eos=True))
                for n, m in (("short", 3), ("long", 10))]
        while eng.has_work:
            eng.step()
        return [s.output_ids for s in seqs], (eng.steps_run, eng.steps_pipelined)

    (plain, _), (piped, counts) = run(False), run(True)
    assert piped == plain and counts == (10, 8)


def test_a_seat_held_by_a_sequence_ending_in_flight_is_not_given_away_early(tiny_checkpoint):
    """max_num_seqs 2: a request that arrives while one of the two running sequences has its last
    token in flight waits for that token to be read back (the scheduler counts it as running), as
    one step at a time; the engine plans the step behind the one in flight the same way."""
    def run(pipelined):
        eng = engine(tiny_checkpoint, pipelined, max_num_seqs=2)
        eng.runner.rides_decode_graph = lambda batch: True
        short, long = (eng.add_request(PROMPTS[n], SamplingParams(max_tokens=m, ignore_eos=True))
                       for n, m in (("short", 3), ("long", 12)))
        while len(short.output_ids) < 2:
            eng.step()
        late = eng.add_request(PROMPTS["late"], SamplingParams(max_tokens=4, ignore_eos=True))
        while eng.has_work:
            eng.step()
        return [s.output_ids for s in (short, long, late)]

    assert run(True) == run(False)


def random_traffic(rng: random.Random) -> tuple[dict, list, int]:
    """An engine config (tight KV cache, small budgets, an admissions cap or none), requests (prompt,
    params, the tokens the caller has seen when it arrives, a cancel or a stop after so many tokens)
    and the most rows a step may have to ride a decode graph."""
    bs, ctx = rng.choice([1, 2, 4, 16]), rng.choice([24, 64, 128])
    seats = rng.randint(2, 5)
    cfg = dict(block_size=bs, max_model_len=ctx, max_num_seqs=seats,
               num_kv_blocks=rng.randint(-(-ctx // bs), ctx // bs + 6),
               max_num_batched_tokens=max(seats, rng.choice([16, 32, 64, 512])),
               max_new_seqs_per_step=rng.choice([0, 0, 1, 2]))
    requests = []
    for i in range(rng.randint(2, 10)):
        params = SamplingParams(max_tokens=rng.randint(1, 40), ignore_eos=rng.random() < 0.5,
                                **(dict(temperature=0.8, seed=i) if rng.random() < 0.3 else {}))
        prompt = [rng.randrange(3, 200) for _ in range(rng.randint(2, 20))]
        requests.append((prompt, params, 0 if i < 2 else rng.randint(0, 30), rng.choice([None, None, rng.randint(1, 10)]),
                         rng.choice([None, None, rng.randint(1, 10)])))
    return cfg, requests, rng.choice([0, 16, 64, 10**6])


@pytest.mark.parametrize("seed", range(12))
def test_random_traffic_gives_the_same_tokens_either_way(tiny_checkpoint, seed):
    """Arrivals, cancels, stop strings, EOS, sampling, preemption, chunked prompts, the admissions
    cap and prompts admitted behind the step in flight (any step of up to `rides` rows rides a decode
    graph): the caller sees the same tokens and endings with async scheduling as without it."""
    rng = random.Random(seed)
    cfg, requests, rides = random_traffic(rng)
    eos = {rng.randrange(0, 200)} if rng.random() < 0.5 else set()

    def run(pipelined):
        eng = engine(tiny_checkpoint, pipelined, **cfg)
        eng.runner.rides_decode_graph = lambda batch: sum(n for _, n in batch) <= rides
        eng.eos, seqs, who, seen = eos, {}, {}, 0
        while eng.has_work or len(seqs) < len(requests):
            for i, (prompt, params, at, _, _) in enumerate(requests):
                if i not in seqs and (at <= seen or not eng.has_work):
                    seqs[i] = eng.add_request(prompt, params)
                    who[id(seqs[i])] = i
            for seq, _ in eng.step():
                seen += 1
                _, _, _, cancel, stop = requests[who[id(seq)]]
                if not seq.finished and cancel == len(seq.output_ids):
                    eng.abort(seq)
                elif not seq.finished and stop == len(seq.output_ids):
                    eng.finish_stopped(seq)
        assert eng.blocks.num_free == eng.blocks.num_blocks and all(s.pending == 0 for s in seqs.values())
        return {i: (s.output_ids, s.finish_reason.value) for i, s in seqs.items()}

    assert run(True) == run(False)
