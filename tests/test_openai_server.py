"""The OpenAI-compatible API on a real tritonserver (tiny checkpoint), through the official `openai`
client: text, 1 and 30 images, streaming, a cancel mid-stream, bad images, both pipelines."""
from __future__ import annotations

import base64

import openai
import pytest

from test_images_server import note
from zipmoe import serve
from zipmoe.clients.triton_client import grpc_generate
from zipmoe.openai_frontend.server import OpenAIFrontend

pytestmark = pytest.mark.integration
QUESTION = "What do these notes say?"


@pytest.fixture(scope="module")
def client(zipmoe_server):
    with OpenAIFrontend(zipmoe_server.url_grpc, port=serve.free_port()) as frontend:
        yield openai.OpenAI(base_url=frontend.url, api_key="none", max_retries=0)


def message(images: list[bytes], question: str = QUESTION) -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(im).decode()}}
             for im in images]
    return [{"role": "user", "content": parts + [{"type": "text", "text": question}]}]


def grpc_answer(server, images, model="mm_qa", **options) -> dict:
    inputs = {"text_input": QUESTION, **options, **({"images": images} if images else {})}
    return list(grpc_generate(server.url_grpc, model=model, **inputs))[-1]


def test_models_are_the_two_pipelines(client):
    assert sorted(m.id for m in client.models.list()) == ["mm_qa", "mm_qa_bls"]


@pytest.mark.parametrize("model", ["mm_qa", "mm_qa_bls"])
@pytest.mark.parametrize("n", [0, 1, 30])
def test_answers_equal_the_grpc_interface(client, zipmoe_server, model, n):
    images = [note(i) for i in range(n)]
    r = client.chat.completions.create(model=model, messages=message(images), max_tokens=12)
    ref = grpc_answer(zipmoe_server, images, model, max_tokens=12)
    assert r.choices[0].message.content == ref["text_output"]
    assert r.usage.prompt_tokens == ref["input_token_count"] and r.usage.completion_tokens == ref["output_token_count"]
    assert r.choices[0].finish_reason == {"eos": "stop", "length": "length"}[ref["finish_reason"]]


def test_streamed_deltas_add_up_to_the_answer_with_usage_last(client):
    kwargs = dict(model="mm_qa", messages=message([note(0), note(1)]), max_tokens=10,
                  extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**kwargs).choices[0].message.content
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole
    assert chunks[-1].usage.completion_tokens == 10 and chunks[-2].choices[0].finish_reason == "length"


def test_seeded_sampling_repeats(client):
    kwargs = dict(model="mm_qa", messages=message([]), max_tokens=8, temperature=1.0, top_p=0.9, seed=1234)
    assert (client.chat.completions.create(**kwargs).choices[0].message.content ==
            client.chat.completions.create(**kwargs).choices[0].message.content)


@pytest.mark.parametrize("model", ["mm_qa", "mm_qa_bls"])
def test_cancel_mid_stream_then_the_server_keeps_answering(client, model):
    stream = client.chat.completions.create(model=model, messages=message([note(0)]), max_tokens=400, stream=True,
                                            extra_body={"ignore_eos": True})
    got = []
    for chunk in stream:
        got.append(chunk)
        if len(got) == 3:
            break
    stream.close()
    r = client.chat.completions.create(model=model, messages=message([note(1)]), max_tokens=4)
    assert r.usage.completion_tokens == 4


@pytest.mark.parametrize("model", ["mm_qa", "mm_qa_bls"])
def test_a_bad_image_is_a_400_naming_it(client, model):
    with pytest.raises(openai.BadRequestError, match="image 1: cannot decode"):
        client.chat.completions.create(model=model, messages=message([note(0), b"\x89PNG broken"]), max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="base64 data URL"):
        client.chat.completions.create(model=model, max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "https://example.com/receipt.png"}},
            {"type": "text", "text": QUESTION}]}])
    assert client.chat.completions.create(model=model, messages=message([note(2)]), max_tokens=4).usage


def test_a_disconnect_on_mm_qa_bls_stops_the_decoding(client, zipmoe_server):
    """The HTTP client goes away mid-stream: the frontend cancels its gRPC stream, mm_qa_bls passes the
    cancel on, and moe_decoder counts it cancelled and gives its KV blocks back (an mm_qa request an
    earlier test cancelled may still be decoding for nobody: server 2.51's ensembles do not pass it on)."""
    import time

    from zipmoe.clients.triton_client import scrape_metrics

    before = scrape_metrics(zipmoe_server.url_metrics)
    stream = client.chat.completions.create(model="mm_qa_bls", messages=message([note(2)]), max_tokens=1000,
                                            stream=True, extra_body={"ignore_eos": True})
    for count, _ in enumerate(stream, 1):
        if count == 3:
            break
    stream.close()
    deadline = time.time() + 30
    while (after := scrape_metrics(zipmoe_server.url_metrics)).get("zipmoe_requests_cancelled_total", 0) <= \
            before.get("zipmoe_requests_cancelled_total", 0):
        assert time.time() < deadline, "moe_decoder never saw the disconnect"
        time.sleep(0.1)
    assert after["zipmoe_requests_cancelled_total"] - before.get("zipmoe_requests_cancelled_total", 0) == 1
    while (after := scrape_metrics(zipmoe_server.url_metrics))["zipmoe_kv_blocks_free"] != after["zipmoe_kv_blocks_total"]:
        assert time.time() < deadline + 60, "KV blocks still held"
        time.sleep(0.2)
