"""The mm_qa ensemble on a real tritonserver: streaming, batching, cancellation, bad input."""
from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from transformers import AutoTokenizer

from zipmoe.clients.triton_client import scrape_metrics
from zipmoe.clients.triton_client import ServerError, grpc_generate, http_generate, http_generate_stream

pytestmark = pytest.mark.integration

QUESTIONS = [
    "What is the total on the receipt?", "你好，这张图片里有什么？", "Which note mentions coffee?",
    "Count the red shapes 🙂", "Compare the two price tags.", "What colour is the background?",
    "Read the table, row two.", "Is there a dog in any picture?",
]


def streamed(url, **inputs):
    responses = list(grpc_generate(url, stream=True, **inputs))
    return "".join(r["text_output"] for r in responses), responses


def test_all_models_ready(zipmoe_server):
    assert zipmoe_server.wait_ready(timeout=5) == [
        "image_decode", "mm_qa", "mm_qa_bls", "moe_decoder", "postprocess", "preprocess", "vision_encoder"]


def test_grpc_stream_and_http_agree(zipmoe_server, tiny_checkpoint):
    q = QUESTIONS[1]
    text, responses = streamed(zipmoe_server.url_grpc, text_input=q, max_tokens=40)
    whole = http_generate(zipmoe_server.url_http, text_input=q, max_tokens=40)
    sse = list(http_generate_stream(zipmoe_server.url_http, text_input=q, max_tokens=40))
    assert text == whole["text_output"] == "".join(r["text_output"] for r in sse)
    n = whole["output_token_count"]
    assert len(responses) == n and [r["output_token_count"] for r in responses] == list(range(1, n + 1))
    assert whole["input_token_count"] == responses[-1]["input_token_count"] > 0
    assert whole["finish_reason"] in ("eos", "length")


def test_concurrent_streams_equal_sequential(zipmoe_server):
    url = zipmoe_server.url_grpc
    sequential = [streamed(url, text_input=q, max_tokens=24, ignore_eos=True)[0] for q in QUESTIONS]
    with ThreadPoolExecutor(len(QUESTIONS)) as pool:
        concurrent = list(pool.map(lambda q: streamed(url, text_input=q, max_tokens=24, ignore_eos=True)[0],
                                   QUESTIONS))
    assert concurrent == sequential


def test_request_joining_mid_generation_finishes_first(zipmoe_server):
    """Continuous batching: a short request sent while a long one decodes is answered before it ends."""
    url = zipmoe_server.url_grpc
    events: queue.Queue = queue.Queue()

    def long_request():
        for r in grpc_generate(url, stream=True, text_input=QUESTIONS[0], max_tokens=300, ignore_eos=True):
            events.put(("long", r["output_token_count"]))
        events.put(("long-done", None))

    t = threading.Thread(target=long_request)
    t.start()
    while events.get(timeout=60)[1] < 5:  # the long request is decoding
        pass
    short = http_generate(zipmoe_server.url_http, text_input=QUESTIONS[2], max_tokens=3, ignore_eos=True)
    seen = []
    while not events.empty():
        seen.append(events.get())
    t.join(timeout=120)
    assert short["output_token_count"] == 3
    assert ("long-done", None) not in seen, "the short request waited for the long one to finish"


def _blocks(server):
    m = scrape_metrics(server.url_metrics)
    return m["zipmoe_kv_blocks_free"], m["zipmoe_kv_blocks_total"]


def open_stream(url, model, tensors):
    """A gRPC stream with one request of hand-made tensors; returns (client, queue of (result, error))."""
    client = grpcclient.InferenceServerClient(url)
    got: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: got.put((result, error)))
    inputs = []
    for name, dtype, value in tensors:
        t = grpcclient.InferInput(name, list(value.shape), dtype)
        t.set_data_from_numpy(value)
        inputs.append(t)
    client.async_stream_infer(model, inputs)
    return client, got


def start_long_stream(url, model, tensors):
    """Opens a stream with one long request and waits for its first 5 responses."""
    client, got = open_stream(url, model, tensors)
    for _ in range(5):
        result, error = got.get(timeout=60)
        assert error is None
    return client


LONG = [("max_tokens", "INT32", np.array([1024], dtype=np.int32)), ("ignore_eos", "BOOL", np.array([True])),
        ("stream", "BOOL", np.array([True]))]


def test_cancelled_stream_frees_its_blocks(zipmoe_server, tiny_checkpoint):
    """The decoder sees the cancellation (is_cancelled) and frees the sequence's KV blocks at once."""
    ids = np.array(AutoTokenizer.from_pretrained(tiny_checkpoint).encode("tell me everything"), dtype=np.int32)
    before = scrape_metrics(zipmoe_server.url_metrics)
    client = start_long_stream(zipmoe_server.url_grpc, "moe_decoder", [("input_ids", "INT32", ids)] + LONG)
    deadline = time.time() + 10  # the gauges are published at most every 100 ms while the engine works
    while (blocks := _blocks(zipmoe_server))[0] == blocks[1]:
        assert time.time() < deadline, "the decoding request holds no KV blocks"
        time.sleep(0.05)
    total = blocks[1]
    client.stop_stream(cancel_requests=True)
    client.close()
    deadline = time.time() + 30
    while _blocks(zipmoe_server)[0] != total:
        assert time.time() < deadline, "cancelled request still holds KV blocks"
        time.sleep(0.2)
    after = scrape_metrics(zipmoe_server.url_metrics)
    # Stopped by the cancellation, not by running out of tokens.
    assert after["zipmoe_requests_cancelled_total"] - before.get("zipmoe_requests_cancelled_total", 0) == 1
    assert after["zipmoe_requests_completed_total"] == before["zipmoe_requests_completed_total"]
    assert http_generate(zipmoe_server.url_http, text_input="still there?", max_tokens=2)["output_token_count"] == 2


BAD = [
    (dict(text_input=""), "text_input is empty"),
    (dict(max_tokens=3), "text_input is empty"),  # left out: server 2.51 would let the ensemble answer nothing
    (dict(text_input="word " * 5000), "context holds"),
    (dict(text_input="hi", max_tokens=0), "max_tokens must be in"),
    (dict(text_input="hi", max_tokens=100000), "max_tokens must be in"),
    (dict(text_input="hi", temperature=-1.0), "temperature"),
    (dict(text_input="hi", top_p=1.5), "top_p"),
    (dict(text_input="hi", top_k=-3), "top_k"),
]


def test_bad_inputs_get_errors_while_good_request_completes(zipmoe_server):
    url = zipmoe_server.url_grpc
    with ThreadPoolExecutor(1) as pool:
        good = pool.submit(streamed, url, text_input=QUESTIONS[3], max_tokens=40, ignore_eos=True)
        for inputs, message in BAD:
            with pytest.raises(ServerError, match=message):
                list(grpc_generate(url, **inputs))
            with pytest.raises(ServerError, match=message):
                http_generate(zipmoe_server.url_http, **inputs)
        text, responses = good.result(timeout=120)
    assert responses[-1]["output_token_count"] == 40


def raw_stream_error(url, model, tensors) -> str:
    """The error text of the first response to hand-made tensors."""
    client, got = open_stream(url, model, tensors)
    _, error = got.get(timeout=60)
    client.stop_stream()
    client.close()
    return str(error)


@pytest.mark.parametrize("name, dtype, value", [
    ("max_tokens", "FP32", np.array([3.0], dtype=np.float32)),
    ("max_tokens", "INT32", np.array([3, 4], dtype=np.int32)),
    ("top_k", "INT32", np.array([[1]], dtype=np.int32)),
    ("no_such_input", "INT32", np.array([1], dtype=np.int32)),
])
def test_wrong_dtype_or_shape_is_named(zipmoe_server, name, dtype, value):
    text = ("text_input", "BYTES", np.array([b"hi"], dtype=object))
    assert name in raw_stream_error(zipmoe_server.url_grpc, "mm_qa", [text, (name, dtype, value)])


def test_stop_words_cut_the_answer(zipmoe_server, tiny_checkpoint):
    url = zipmoe_server.url_grpc
    full, _ = streamed(url, text_input=QUESTIONS[0], max_tokens=40, ignore_eos=True)
    stop = full[10:14]
    assert stop.strip(), "pick a visible stop string"
    text, responses = streamed(url, text_input=QUESTIONS[0], max_tokens=40, ignore_eos=True, stop_words=[stop])
    assert text == full[: full.index(stop)]
    assert responses[-1]["finish_reason"] == "stop"


def test_server_reports_ttft_and_tpot(zipmoe_server):
    before = scrape_metrics(zipmoe_server.url_metrics)
    http_generate(zipmoe_server.url_http, text_input="hi", max_tokens=8, ignore_eos=True)
    after = scrape_metrics(zipmoe_server.url_metrics)
    assert after["zipmoe_requests_completed_total"] - before["zipmoe_requests_completed_total"] == 1
    assert after["zipmoe_decode_tokens_total"] - before["zipmoe_decode_tokens_total"] == 7
    assert after["zipmoe_ttft_microseconds_total"] > before["zipmoe_ttft_microseconds_total"]
