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
    assert not thread.is_alive() and 0.2 <= waited[0] < 5
    assert time.monotonic() - released >= 0.025  # then the hand-off's grace, for the request to arrive
    holder.close()
    assert not (tmp_path / "turn").exists()


def test_the_wait_never_outlasts_the_holders_deadline(tmp_path):
    holder = TurnHolder(tmp_path / "turn", 150)
    with holder.held():
        waited = TurnWaiter(tmp_path / "turn").wait(arrived=lambda: False)
        assert 0.1 <= waited < 1.0  # a holder that hangs blocks the decoder for gpu_turn_ms at most
    holder.close()


def test_an_arrival_ends_the_wait(tmp_path):
    holder = TurnHolder(tmp_path / "turn", 5_000)
    calls = []
    with holder.held():
        waited = TurnWaiter(tmp_path / "turn").wait(arrived=lambda: calls.append(1) or len(calls) > 3)
    assert waited < 1.0 and len(calls) == 4
    holder.close()


def test_running_streams_pause_while_the_turn_is_held(tiny_checkpoint, tmp_path):
    """The decoder's loop: a stream that is decoding stops producing tokens while the turn is held,
    resumes after, and the pause is counted."""
    engine = LLMEngine(tiny_checkpoint, EngineConfig(device="cpu", num_kv_blocks=64, max_model_len=256,
                                                     max_num_batched_tokens=512))
    path = tmp_path / "turn"
    holder = TurnHolder(path, 5_000)
    svc = DecoderService(engine, TokenBytes.from_tokenizer_json(tiny_checkpoint), DecoderConfig(),
                         gpu_turn=TurnWaiter(path))
    try:
        sink = Sink()
        svc.submit(DecodeRequest(PROMPT, {"max_tokens": 200, "ignore_eos": True, "stream": True}), sink)
        deadline = time.monotonic() + 30
        while len(sink.responses) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        with holder.held():
            time.sleep(0.3)  # responses of the steps before the hold may still be on their way
            held = len(sink.responses)
            time.sleep(0.5)
            assert len(sink.responses) == held and not sink.done.is_set()
        assert sink.done.wait(60) and sink.errors == [] and sink.finals == 1
        stats = svc.stats()
        assert stats["gpu_turn_waits"] >= 1 and stats["gpu_turn_wait_us"] >= 400_000
    finally:
        svc.shutdown()
        holder.close()
