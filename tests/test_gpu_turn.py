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
from zipmoe.serving.gpu_turn import TurnHolder, TurnWaiter, turn_path
from test_decoder_service import PROMPT, Sink


def test_one_segment_per_server_and_gpu_none_off_cuda(tmp_path):
    a, b = tmp_path / "repo_a" / "vision_encoder", tmp_path / "repo_b" / "moe_decoder"
    assert turn_path(a, "cpu") is None
    assert turn_path(a, "cuda:0") == turn_path(a.parent / "moe_decoder", torch.device("cuda", 0))
    assert len({turn_path(a, "cuda:0"), turn_path(a, "cuda:1"), turn_path(b, "cuda:0")}) == 3


def test_no_holder_no_wait(tmp_path):
    assert TurnWaiter(tmp_path / "turn").wait(arrived=lambda: False) == 0.0
    assert TurnWaiter(None).wait(arrived=lambda: False) == 0.0


def test_a_turn_of_zero_ms_holds_nothing(tmp_path):
    holder = TurnHolder(tmp_path / "turn", 0)
    with holder.held():
        assert TurnWaiter(tmp_path / "turn").wait(arrived=lambda: False) == 0.0
    assert not (tmp_path / "turn").exists()


def test_the_waiter_waits_for_the_release_then_the_handoff(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_turn, "HANDOFF_MS", 30.0)
    holder, waiter = TurnHolder(tmp_path / "turn", 5_000), TurnWaiter(tmp_path / "turn")
    waited = []
    with holder.held():
        thread = threading.Thread(target=lambda: waited.append(waiter.wait(arrived=lambda: False)))
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
        waited = TurnWaiter(tmp_path / "turn").wait(arrived=lambda: False)
        assert 0.1 <= waited < 1.0  # a holder that hangs blocks the decoder for gpu_turn_ms at most
    holder.close()


def test_a_batch_without_images_takes_no_turn(tmp_path):
    holder = TurnHolder(tmp_path / "turn", 5_000)
    with holder.held(False):  # text-only requests pass through vision_encoder in mm_qa
        assert TurnWaiter(tmp_path / "turn").wait(arrived=lambda: False) == 0.0
    holder.close()


def test_only_an_arrival_after_the_release_ends_the_wait(tmp_path, monkeypatch):
    """A request that comes while the tower works is someone else's and waits for the turn too; once the
    holder released, the next one (its own image request) ends the wait before the hand-off runs out."""
    monkeypatch.setattr(gpu_turn, "HANDOFF_MS", 5_000.0)
    holder, waiter = TurnHolder(tmp_path / "turn", 60_000), TurnWaiter(tmp_path / "turn")
    calls, waited = [], []
    with holder.held():
        thread = threading.Thread(target=lambda: waited.append(waiter.wait(arrived=lambda: calls.append(1) or True)))
        thread.start()
        time.sleep(0.2)
        assert thread.is_alive() and calls == []  # arrivals are not even asked about while the holder works
    thread.join(5)
    assert not thread.is_alive() and 0.15 <= waited[0] < 1.0 and len(calls) == 1
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
    """A decoding stream produces no token while the turn is held, resumes after, and the pause is counted."""
    holder, svc = TurnHolder(tmp_path / "turn", 5_000), service(tiny_checkpoint, tmp_path / "turn")
    try:
        sink = stream(svc)
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
