"""mm_qa_bls on a real server: the same answers as the mm_qa ensemble, the visual-feature cache, validation."""
from __future__ import annotations

import asyncio
import time

import pytest
import tritonclient.grpc.aio as grpc_aio

from test_images_server import note
from zipmoe.clients.triton_client import ServerError, grpc_generate, grpc_generate_async, scrape_metrics

pytestmark = pytest.mark.integration


def streamed(server, model, images, keep=None, **extra):
    """Greedy streamed answer: every response, each text delta and count included."""
    inputs = dict(text_input="What do these notes say?", max_tokens=12, ignore_eos=True, stream=True, **extra)
    if images:
        inputs["images"] = images
    if keep is not None:
        inputs["visual_keep_ratio"] = keep
    return list(grpc_generate(server.url_grpc, model=model, **inputs))


def cache_counts(server) -> dict[str, float]:
    metrics = scrape_metrics(server.url_metrics)
    return {k: metrics.get(f"zipmoe_bls_cache_{k}", 0.0) for k in ("hits_total", "misses_total", "bytes")}


# In this order the cache changes the batches: 3 images = 1 cached + 2 encoded together, 30 = 3 + 27.
@pytest.mark.parametrize("n", [0, 1, 3, 30])
@pytest.mark.parametrize("keep", [1.0, 0.6])
def test_same_answers_as_the_ensemble(zipmoe_server, n, keep):
    images = [note(i) for i in range(n)]
    ensemble = streamed(zipmoe_server, "mm_qa", images, keep)
    bls = streamed(zipmoe_server, "mm_qa_bls", images, keep)
    assert bls == ensemble
    assert len(bls) == 12 and len(bls[-1]["visual_tokens_kept"]) == n


def test_repeated_image_is_served_from_the_cache(zipmoe_server):
    image = note(41)  # not used by any other test
    before = cache_counts(zipmoe_server)
    first = streamed(zipmoe_server, "mm_qa_bls", [image])
    seen = cache_counts(zipmoe_server)
    again = streamed(zipmoe_server, "mm_qa_bls", [note(40), image], keep=1.0)
    after = cache_counts(zipmoe_server)
    assert seen["misses_total"] - before["misses_total"] == 1 and seen["hits_total"] == before["hits_total"]
    assert after["hits_total"] - seen["hits_total"] == 1 and after["misses_total"] - seen["misses_total"] == 1
    assert after["bytes"] > 0
    assert first == streamed(zipmoe_server, "mm_qa_bls", [image])  # a cached image answers the same
    assert again == streamed(zipmoe_server, "mm_qa", [note(40), image], keep=1.0)


def test_too_many_images_is_refused(zipmoe_server):
    with pytest.raises(ServerError, match="65 images; this deployment accepts at most 64"):
        streamed(zipmoe_server, "mm_qa_bls", [note(0)] * 65)


@pytest.mark.parametrize("images, message", [
    ([b""], "image 0: empty"),
    ([note(0), b"not an image at all"], "image 1"),  # note(0) is cached: image_decode gets only the bad one
    ([note(1), note(2)[:40]], "image 1"),
])
def test_bad_image_is_named_and_the_next_request_works(zipmoe_server, images, message):
    with pytest.raises(ServerError, match=message):
        streamed(zipmoe_server, "mm_qa_bls", images)
    assert streamed(zipmoe_server, "mm_qa_bls", [note(3)])[-1]["output_token_count"] == 12


@pytest.mark.parametrize("inputs, message", [
    (dict(text_input="  "), "text_input is empty"),
    (dict(text_input="What is this?", images=[note(0)], visual_keep_ratio=1.5), "visual_keep_ratio"),
])
def test_invalid_request_is_refused(zipmoe_server, inputs, message):
    with pytest.raises(ServerError, match=message):
        list(grpc_generate(zipmoe_server.url_grpc, model="mm_qa_bls", **inputs))


def wait_for_cancel_counted(server, before: dict, deadline: float) -> dict:
    """The metrics once moe_decoder counted one more cancelled request (and no other)."""
    while True:
        after = scrape_metrics(server.url_metrics)
        if after.get("zipmoe_requests_cancelled_total", 0) > before.get("zipmoe_requests_cancelled_total", 0):
            break
        assert time.time() < deadline, "moe_decoder never saw the cancellation"
        time.sleep(0.1)
    assert after["zipmoe_requests_cancelled_total"] - before.get("zipmoe_requests_cancelled_total", 0) == 1
    return after


def test_a_cancelled_non_streamed_request_stops_the_decoder_before_its_answer(zipmoe_server):
    """A non-streamed answer is one decoder response at its end: mm_qa_bls looks at its client while it
    waits, so a client gone mid-generation stops the decoder all the same."""
    before = scrape_metrics(zipmoe_server.url_metrics)

    async def ask_then_leave():
        client = grpc_aio.InferenceServerClient(zipmoe_server.url_grpc)
        try:
            answer = asyncio.ensure_future(anext(grpc_generate_async(
                client, "mm_qa_bls", text_input="Tell me everything.", max_tokens=1000, ignore_eos=True,
                stream=False)))
            while not scrape_metrics(zipmoe_server.url_metrics).get("zipmoe_running_requests"):
                assert not answer.done(), "answered before it could be cancelled"
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.5)  # decoding
            assert not answer.done(), "answered before it could be cancelled"
            answer.cancel()  # the gRPC call is cancelled with it
            await asyncio.gather(answer, return_exceptions=True)
        finally:
            await client.close()

    asyncio.run(ask_then_leave())
    wait_for_cancel_counted(zipmoe_server, before, time.time() + 30)


def test_cancelled_stream_stops_the_decoder_and_leaves_the_server_answering(zipmoe_server):
    """mm_qa_bls passes the client's cancel on to moe_decoder (a control call naming the request):
    the request is counted cancelled, and the KV blocks all come back."""
    before = scrape_metrics(zipmoe_server.url_metrics)
    stream = grpc_generate(zipmoe_server.url_grpc, model="mm_qa_bls", text_input="Tell me everything.",
                           images=[note(5)], max_tokens=1000, ignore_eos=True, stream=True)
    for count, _ in enumerate(stream, 1):
        if count == 3:
            break
    stream.close()  # stops the gRPC stream with cancel_requests=True
    deadline = time.time() + 30
    after = wait_for_cancel_counted(zipmoe_server, before, deadline)
    while (after := scrape_metrics(zipmoe_server.url_metrics))["zipmoe_kv_blocks_free"] != after["zipmoe_kv_blocks_total"]:
        assert time.time() < deadline + 60, "KV blocks still held"
        time.sleep(0.2)
    assert streamed(zipmoe_server, "mm_qa_bls", [note(5)])[-1]["output_token_count"] == 12


@pytest.mark.parametrize("model", ["mm_qa_bls", "mm_qa"])
@pytest.mark.parametrize("outputs", [["text_output"], ["finish_reason", "output_token_count"]])
def test_a_client_naming_some_outputs_gets_those_and_the_server_lives(zipmoe_server, model, outputs):
    """Server 2.51's stub dropped the unrequested outputs of a decoupled response on a thread without a
    Python thread state; that could kill the stub (models/stub_safety.py). The decoupled models now
    build only what was asked for."""
    full = streamed(zipmoe_server, model, [note(6)])
    some = list(grpc_generate(zipmoe_server.url_grpc, model=model, outputs=outputs, text_input="What do these notes say?",
                              images=[note(6)], max_tokens=12, ignore_eos=True, stream=True))
    assert [set(r) for r in some] == [set(outputs)] * len(full)
    assert some == [{name: r[name] for name in outputs} for r in full]
    assert streamed(zipmoe_server, model, [note(6)]) == full


def test_moe_decoder_called_directly_sends_only_the_named_outputs(zipmoe_server):
    import numpy as np
    import tritonclient.grpc as grpcclient

    def decode(outputs):
        client, results = grpcclient.InferenceServerClient(zipmoe_server.url_grpc), []
        client.start_stream(callback=lambda result, error: results.append((result, error)))
        ids = grpcclient.InferInput("input_ids", [3], "INT32")
        ids.set_data_from_numpy(np.asarray([11, 12, 13], np.int32))
        count = grpcclient.InferInput("max_tokens", [1], "INT32")
        count.set_data_from_numpy(np.asarray([4], np.int32))
        wanted = None if outputs is None else [grpcclient.InferRequestedOutput(n) for n in outputs]
        client.async_stream_infer("moe_decoder", [ids, count], outputs=wanted)
        client.stop_stream()  # waits for the (single, final) response
        client.close()
        (result, error), = results
        assert error is None, error
        return {o.name: result.as_numpy(o.name).tolist() for o in result.get_response().outputs}

    everything = decode(None)
    assert len(everything) == 7
    for _ in range(3):  # each send used to free the six dropped tensors off the GIL
        assert decode(["output_ids"]) == {"output_ids": everything["output_ids"]}
    assert decode(None) == everything
