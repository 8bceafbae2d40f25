"""mm_qa_bls's VisionBatcher: concurrent requests share one vision call; a bad image fails only its owner."""
from __future__ import annotations

import sys
import threading
import time
import types
from concurrent.futures import ThreadPoolExecutor

import pytest


@pytest.fixture()
def bls(monkeypatch):
    """The module, importable outside the Triton stub (only a constant of pb_utils is read at import)."""
    fake = types.ModuleType("triton_python_backend_utils")
    fake.TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", fake)
    monkeypatch.delitem(sys.modules, "zipmoe.models.mm_qa_bls", raising=False)
    import zipmoe.models.mm_qa_bls as module

    return module


def test_waiting_requests_share_one_call_and_errors_stay_with_their_owner(bls, monkeypatch):
    calls, first_started, release = [], threading.Event(), threading.Event()

    def encode(images):
        calls.append(list(images))
        if len(calls) == 1:  # hold the first call until the others are queued behind it
            first_started.set()
            release.wait(5)
        if b"bad" in images:
            raise bls.ModelError("image_decode: image 0: cannot decode")
        return [f"features of {im.decode()}" for im in images]

    monkeypatch.setattr(bls, "encode_images", encode)
    batcher = bls.VisionBatcher(max_images=8)
    with ThreadPoolExecutor(4) as pool:
        first = pool.submit(batcher.features, [b"a"])
        first_started.wait(5)
        rest = [pool.submit(batcher.features, imgs) for imgs in ([b"b", b"c"], [b"bad"], [b"d"])]
        deadline = time.monotonic() + 5
        while batcher._queue.qsize() < 3 and time.monotonic() < deadline:
            time.sleep(0.001)
        release.set()
        assert first.result(5) == ["features of a"]
        assert rest[0].result(5) == ["features of b", "features of c"]
        with pytest.raises(bls.ModelError, match="cannot decode"):
            rest[1].result(5)
        assert rest[2].result(5) == ["features of d"]
    assert calls[1] == [b"b", b"c", b"bad", b"d"]  # the three waiting requests went as one call
    assert [b"bad"] in calls[2:] and [b"d"] in calls[2:]  # then, after it failed, one by one
