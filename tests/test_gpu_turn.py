"""Turns on a shared GPU: vision_encoder's hold, moe_decoder's wait (alone, and in the decoder's loop)."""
from __future__ import annotations

import threading
import time

import torch

from zipmoe.detokenize import TokenBytes
from zipmoe.engine.engine import EngineConfig, LLMEngine
from zipmoe.serving import gpu_turn
from zipmoe.serving.decode_request import DecodeRequest
from zipmoe.serving.decoder import DecoderConfig, DecoderService
from zipmoe.serving.gpu_turn import BUSY, TurnHolder, TurnWaiter, paused_path, turn_path
from zipmoe.serving.shared_level import LevelReader
from test_decoder_service import PROMPT, Sink


def waits(waiter: TurnWaiter, arrivals=lambda: 0, stopping=lambda: False) -> float:
    """What the decoder does before a step: held() (it reads back its step in flight), then wait()."""
    waiter.held()
    return waiter.wait(arrivals, stopping)


def test_one_segment_per_server_and_gpu_none_off_cuda(tmp_path):
    a, b = tmp_path / "repo_a" / "vision_encoder", tmp_path / "repo_b" / "moe_decoder"
    assert turn_path(a, "cpu") is None
    assert turn_path(a, "cuda:0") == turn_path(a.parent / "moe_decoder", torch.device("cuda", 0))
    assert len({turn_path(a, "cuda:0"), turn_path(a, "cuda:1"), turn_path(b, "cuda:0")}) == 3


def test_no_holder_no_wait(tmp_path):
    assert waits(TurnWaiter(tmp_path / "turn")) == 0.0
    assert waits(TurnWaiter(None)) == 0.0


def test_a_turn_of_zero_ms_holds_nothing(tmp_path):
    holder = TurnHolder(tmp_path / "turn", 0)
    with holder.held():
        assert waits(TurnWaiter(tmp_path / "turn")) == 0.0
    assert not (tmp_path / "turn").exists()


def test_the_waiter_waits_for_the_release_then_the_handoff(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_turn, "HANDOFF_MS", 30.0)
    holder, waiter = TurnHolder(tmp_path / "turn", 5_000), TurnWaiter(tmp_path / "turn")
    waited = []
    with holder.held():
        thread = threading.Thread(target=lambda: waited.append(waits(waiter)))
        thread.start()
        time.sleep(0.2)
        assert thread.is_alive()  # the turn is held: no step
    released = time.monotonic()
    thread.join(5)
    assert not thread.is_alive() and 0.15 <= waited[0] < 5
    assert time.monotonic() - released >= 0.025  # then the hand-off's grace, for the request to arrive
    holder.close()
    assert not (tmp_path / "turn").exists()


def test_the_wait_never_outlasts_the_holders_deadline(tmp_path):
    holder = TurnHolder(tmp_path / "turn", 150)
    with holder.held():
        waited = waits(TurnWaiter(tmp_path / "turn"))
        assert 0.1 <= waited < 1.0  # a holder that hangs blocks the decoder for gpu_turn_ms at most
    holder.close()


def test_a_batch_without_images_takes_no_turn(tmp_path):
    holder = TurnHolder(tmp_path / "turn", 5_000)
    with holder.held(False):  # text-only requests pass through vision_encoder in mm_qa
        assert waits(TurnWaiter(tmp_path / "turn")) == 0.0
    holder.close()


def test_only_an_arrival_after_the_release_ends_the_wait(tmp_path, monkeypatch):
    """A request that comes while the tower works is someone else's (still queued when the turn ends) and
    waits for the turn too; once the holder released, the next one (its own image request) ends the wait
    before the hand-off runs out; stopping the service ends it at any time."""
    monkeypatch.setattr(gpu_turn, "HANDOFF_MS", 5_000.0)
    holder, waiter = TurnHolder(tmp_path / "turn", 60_000), TurnWaiter(tmp_path / "turn")
    arrivals, waited, started = [1], [], threading.Event()

    def decoder():
        assert waiter.held()
        started.set()
        waited.append(waiter.wait(lambda: arrivals[0], lambda: False))

    with holder.held():
        thread = threading.Thread(target=decoder)
        thread.start()
        assert started.wait(5)
        arrivals[0] += 1  # another client's request, during the turn
        time.sleep(0.2)
        assert thread.is_alive()
    time.sleep(0.3)  # released: the decoder has seen the release (and the count then) by now
    assert thread.is_alive()  # the request of the turn is still queued: not an arrival after the release
    arrivals[0] += 1
    thread.join(5)
    assert not thread.is_alive() and waited[0] < 4  # not the 5 s hand-off
    with holder.held():
        stopped = waits(waiter, stopping=lambda: True)  # (the last call slept: this one lets its step go) ...
        assert stopped == 0.0 and waits(waiter, stopping=lambda: True) < 1  # ... and a stop ends a wait at once
    waiter.close()
    holder.close()


def test_the_holder_starts_once_a_busy_decoder_paused(tmp_path, monkeypatch):
    """The tower's work waits for the decoder's step in flight: a decoder with work shows BUSY, and the
    holder's turn begins only once the decoder pauses for it (its wait())."""
    monkeypatch.setattr(gpu_turn, "PAUSE_WAIT_MS", 5_000.0)
    holder, waiter = TurnHolder(tmp_path / "turn", 5_000), TurnWaiter(tmp_path / "turn")
    waiter.busy(True)
    entered = []

    def hold():
        with holder.held():
            entered.append(time.monotonic())

    thread = threading.Thread(target=hold)
    thread.start()
    turn, deadline = LevelReader(tmp_path / "turn"), time.monotonic() + 5
    while not turn.read() and time.monotonic() < deadline:  # the holder has taken its turn ...
        time.sleep(0.001)
    time.sleep(0.05)
    assert turn.read() and entered == []  # ... and waits: the decoder may still have a step on the GPU
    paused = time.monotonic()
    assert waits(waiter) > 0  # pauses; the holder's work runs and releases; the hand-off runs out
    thread.join(5)
    assert len(entered) == 1 and entered[0] >= paused
    assert LevelReader(paused_path(tmp_path / "turn")).read() == BUSY  # stepping again
    waiter.close()
    holder.close()


def test_the_holder_waits_for_no_idle_decoder_and_for_a_busy_one_at_most_pause_wait_ms(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_turn, "PAUSE_WAIT_MS", 300.0)
    holder, waiter = TurnHolder(tmp_path / "turn", 5_000), TurnWaiter(tmp_path / "turn")
    for has_work, low, high in ((False, 0.0, 0.1), (True, 0.25, 2.0)):
        waiter.busy(has_work)
        start = time.monotonic()
        with holder.held():
            took = time.monotonic() - start
        assert low <= took < high
    waiter.close()
    assert not paused_path(tmp_path / "turn").exists()
    holder.close()


def service(checkpoint, path):
    engine = LLMEngine(checkpoint, EngineConfig(device="cpu", num_kv_blocks=128, max_model_len=1100,
                                                max_num_batched_tokens=512))
    return DecoderService(engine, TokenBytes.from_tokenizer_json(checkpoint), DecoderConfig(),
                          gpu_turn=TurnWaiter(path))


def stream(svc, tokens: int = 1000) -> Sink:
    """A request decoding (its first 3 tokens out) that will not finish within the test's holds."""
    sink = Sink()
    svc.submit(DecodeRequest(PROMPT, {"max_tokens": tokens, "ignore_eos": True, "stream": True}), sink)
    deadline = time.monotonic() + 30
    while len(sink.responses) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(sink.responses) >= 3
    return sink


def test_running_streams_pause_while_the_turn_is_held(tiny_checkpoint, tmp_path):
    """A decoding stream produces no token while the turn is held, resumes after, and the pause is counted;
    the decoder shows BUSY to holders while it has work, idle once it has none, and nothing after shutdown."""
    holder, svc = TurnHolder(tmp_path / "turn", 5_000), service(tiny_checkpoint, tmp_path / "turn")
    state = LevelReader(paused_path(tmp_path / "turn"))
    try:
        sink = stream(svc)
        assert state.read() == BUSY
        with holder.held():
            time.sleep(0.3)  # responses of the steps before the hold may still be on their way
            held = len(sink.responses)
            time.sleep(0.5)
            assert len(sink.responses) == held
        deadline = time.monotonic() + 30
        while len(sink.responses) < held + 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(sink.responses) >= held + 3 and sink.errors == []
        stats = svc.stats()
        assert stats["gpu_turn_waits"] >= 1 and stats["gpu_turn_wait_us"] >= 400_000
    finally:
        svc.shutdown()
        holder.close()
    assert not paused_path(tmp_path / "turn").exists()


def test_the_step_in_flight_is_sent_before_the_pause(tiny_checkpoint, tmp_path):
    """With async scheduling a step is on the device when a turn begins. Its token goes out before
    the decoder sleeps, not after the turn with the next step's launch: while the turn is held the
    stream has every token its engine made (one pause per turn, not two)."""
    holder, svc = TurnHolder(tmp_path / "turn", 5_000), service(tiny_checkpoint, tmp_path / "turn")
    try:
        sink = stream(svc)
        with holder.held():
            time.sleep(0.3)
            (seq,) = svc.engine.scheduler.running
            assert seq.pending == 0 and len(sink.responses) == len(seq.output_ids)
        assert svc.engine.steps_pipelined > 0  # the steps before the turn were pipelined
    finally:
        svc.shutdown()
        holder.close()


def test_an_arriving_request_ends_the_pause_and_is_answered(tiny_checkpoint, tmp_path, monkeypatch):
    """The image request whose tokens the holder just made reaches the decoder during the hand-off:
    it is admitted and answered at once, and that turn is not waited for again."""
    monkeypatch.setattr(gpu_turn, "HANDOFF_MS", 60_000.0)  # a hand-off the test would notice
    holder, svc = TurnHolder(tmp_path / "turn", 60_000), service(tiny_checkpoint, tmp_path / "turn")
    try:
        sink = stream(svc)
        with holder.held():
            time.sleep(0.2)
        time.sleep(0.3)  # released: the decoder now waits for the hand-off
        held, arrival = len(sink.responses), Sink()
        svc.submit(DecodeRequest(PROMPT, {"max_tokens": 4, "ignore_eos": True, "stream": True}), arrival)
        assert arrival.done.wait(30) and arrival.errors == [] and len(arrival.responses) == 4
        deadline = time.monotonic() + 30
        while len(sink.responses) < held + 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(sink.responses) >= held + 3  # the running stream goes on too
    finally:
        svc.shutdown()
        holder.close()


def test_a_request_reaching_an_idle_decoder_waits_while_the_tower_works(tiny_checkpoint, tmp_path):
    """An idle decoder that gets a request while the tower works holds that request's first step until the
    release (it would run beside the tower); one that comes after the release (the image request the
    tower just made) is answered at once."""
    holder, svc = TurnHolder(tmp_path / "turn", 60_000), service(tiny_checkpoint, tmp_path / "turn")
    try:
        early = Sink()
        with holder.held():
            svc.submit(DecodeRequest(PROMPT, {"max_tokens": 2, "ignore_eos": True, "stream": True}), early)
            time.sleep(0.5)
            assert early.responses == []
        assert early.done.wait(30) and early.errors == [] and len(early.responses) == 2
        later = Sink()
        svc.submit(DecodeRequest(PROMPT, {"max_tokens": 2, "ignore_eos": True, "stream": True}), later)
        assert later.done.wait(30) and later.errors == []
    finally:
        svc.shutdown()
        holder.close()


def test_turns_back_to_back_leave_the_streams_a_step_between_them(tiny_checkpoint, tmp_path):
    """A holder that takes turn after turn with no gap (and no request following) cannot starve the
    running streams: the decoder never holds back two steps in a row."""
    holder, svc = TurnHolder(tmp_path / "turn", 200), service(tiny_checkpoint, tmp_path / "turn")
    try:
        sink = stream(svc)
        before, stop = len(sink.responses), time.monotonic() + 2.0
        while time.monotonic() < stop:
            with holder.held():
                time.sleep(0.15)
        assert len(sink.responses) > before + 3 and sink.errors == []
        assert svc.stats()["gpu_turn_waits"] >= 2
    finally:
        svc.shutdown()
        holder.close()
