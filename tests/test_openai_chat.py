"""The OpenAI frontend without Triton: chat requests -> mm_qa inputs (openai_frontend.chat), and the
ASGI app under uvicorn over a fake mm_qa, driven by the official `openai` client and by httpx
(streaming format, errors in OpenAI's shape, busy as a 503 to retry, a disconnect cancelling the request)."""
from __future__ import annotations

import asyncio
import base64
import threading

import httpx
import openai
import pytest

from zipmoe import serve
from zipmoe.clients.triton_client import ServerError
from zipmoe.openai_frontend.app import create_app
from zipmoe.openai_frontend.chat import OpenAIError, parse_chat, server_error
from zipmoe.openai_frontend.server import OpenAIFrontend

MODELS = ("mm_qa", "mm_qa_bls")
PNG = base64.b64decode("iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAIAAACQd1PeAAAADElEQVR4nGP4z8AAAAMBAQDJ/pLvAAAAAElFTkSuQmCC")
DATA_URL = "data:image/png;base64," + base64.b64encode(PNG).decode()
BUSY = "server busy: 2 requests waiting in moe_decoder (max_waiting_requests 2); retry later"


def user(*parts) -> dict:
    return {"role": "user", "content": [p if isinstance(p, dict) else
                                        {"type": "image_url", "image_url": {"url": p}} if p.startswith(("data:", "http"))
                                        else {"type": "text", "text": p} for p in parts]}


def chat(*messages, **params):
    return parse_chat({"model": "mm_qa", "messages": list(messages), **params}, MODELS)


# ---------------------------------------------------------------- chat -> mm_qa inputs

def test_one_user_message_is_the_question_and_its_images_go_in_order():
    request = chat(user(DATA_URL, "what is the total?", DATA_URL))
    assert request.inputs == {"text_input": "what is the total?", "images": [PNG, PNG]}
    assert chat({"role": "user", "content": "hi"}).inputs == {"text_input": "hi"}


def test_a_conversation_becomes_one_question():
    request = chat({"role": "system", "content": "Answer briefly."}, user(DATA_URL, "what does it show?"),
                   {"role": "assistant", "content": "a receipt"}, user(DATA_URL, "and the total?"))
    assert request.inputs["text_input"] == ("Answer briefly.\n\nuser: what does it show?\n\nassistant: a receipt"
                                            "\n\nand the total?")
    assert request.inputs["images"] == [PNG, PNG]


def test_sampling_parameters_map_onto_mm_qa_inputs():
    request = chat(user("q"), max_tokens=5, max_completion_tokens=7, temperature=1, top_p=0.5, seed=-1,
                   stop="\n", top_k=3, ignore_eos=True, visual_keep_ratio=0.4, priority=0, stream=True,
                   stream_options={"include_usage": True})
    assert request.inputs == {"text_input": "q", "max_tokens": 7, "temperature": 1.0, "top_p": 0.5,
                              "random_seed": 2**64 - 1, "top_k": 3, "ignore_eos": True, "visual_keep_ratio": 0.4,
                              "priority": 0, "stop_words": ["\n"]}
    assert request.stream and request.include_usage
    assert not chat(user("q"), stream_options={"include_usage": True}).include_usage  # only when streaming


@pytest.mark.parametrize("body, status, param", [
    ({"messages": [{"role": "user", "content": "q"}]}, 400, "model"),
    ({"model": "gpt-4o", "messages": [{"role": "user", "content": "q"}]}, 404, "model"),
    ({"model": "mm_qa", "messages": []}, 400, "messages"),
    ({"model": "mm_qa", "messages": [user("q", "https://example.com/a.png")]}, 400, "messages[0].content[1].image_url"),
    ({"model": "mm_qa", "messages": [user("q", "data:image/png;base64,#")]}, 400, "messages[0].content[1].image_url"),
    ({"model": "mm_qa", "messages": [user("q"), {"role": "assistant", "content": "a"}]}, 400, "messages[1]"),
    ({"model": "mm_qa", "messages": [{"role": "assistant", "content": [{"type": "image_url", "image_url": {"url": DATA_URL}}]},
                                     user("q")]}, 400, "messages[0].content[0]"),
    ({"model": "mm_qa", "messages": [{"role": "tool", "content": "x"}]}, 400, "messages[0].role"),
    ({"model": "mm_qa", "messages": [user(DATA_URL)]}, 400, "messages[0].content"),
    ({"model": "mm_qa", "messages": [user("q")], "n": 2}, 400, "n"),
    ({"model": "mm_qa", "messages": [user("q")], "temperature": 3}, 400, "temperature"),
    ({"model": "mm_qa", "messages": [user("q")], "max_tokens": True}, 400, "max_tokens"),
    ({"model": "mm_qa", "messages": [user("q")], "stop": [1]}, 400, "stop"),
    ({"model": "mm_qa", "messages": [user("q")], "response_format": {"type": "json_object"}}, 400, "response_format"),
    ({"model": 123, "messages": [user("q")]}, 400, "model"),
    ({"model": "mm_qa", "messages": [{"role": "user", "content": [{"type": "text"}]}]}, 400,
     "messages[0].content[0].text"),
    ({"model": "mm_qa", "messages": [user("q", "data:text/plain;base64,aGVsbG8=")]}, 400,
     "messages[0].content[1].image_url"),
    ({"model": "mm_qa", "messages": [{"role": "user", "content": "\ud800 hi"}]}, 400, "messages[0].content"),
    ({"model": "mm_qa", "messages": [user("\ud800 hi")]}, 400, "messages[0].content[0].text"),
    ({"model": "mm_qa", "messages": [user("q")], "stop": ["\udfff"]}, 400, "stop"),
    ({"model": "mm_qa", "messages": [user("q")], "seed": 2**64 + 11}, 400, "seed"),
    ({"model": "mm_qa", "messages": [user("q")], "seed": -2**63 - 1}, 400, "seed"),
    ({"model": "mm_qa", "messages": [user("q")], "max_tokens": 2**32 + 3}, 400, "max_tokens"),
    ({"model": "mm_qa", "messages": [user("q")], "priority": 2**32}, 400, "priority"),
    ({"model": "mm_qa", "messages": [user("q")], "top_k": 2**32 + 1}, 400, "top_k"),
    ({"model": "mm_qa", "messages": [{"role": "user", "content": ["q"]}]}, 400, "messages[0].content[0]"),
    ({"model": "mm_qa", "messages": [user("q", "data:image/png;base64,\ud800")]}, 400,
     "messages[0].content[1].image_url"),
])
def test_requests_it_cannot_serve_are_refused_naming_the_parameter(body, status, param):
    with pytest.raises(OpenAIError) as e:
        parse_chat(body, MODELS)
    assert (e.value.status, e.value.param) == (status, param)
    assert e.value.body["error"]["type"] == "invalid_request_error" and e.value.body["error"]["message"]


def test_triton_errors_are_the_client_s_unless_the_server_says_otherwise():
    assert server_error("in ensemble 'mm_qa', image_decode: image 0: empty").status == 400
    assert server_error("vision_encoder: internal error: RuntimeError('x')").status == 500
    assert server_error("the server is shutting down").status == 503
    assert server_error("failed to connect", unavailable=True).status == 503
    busy = server_error(f"in ensemble 'mm_qa', {BUSY}")
    assert (busy.status, busy.headers, busy.body["error"]["type"]) == (503, {"retry-after": "1"}, "server_error")
    assert server_error("the server is shutting down").headers == {}
    # Triton's words while `zipmoe serve` drains (the entry models unloaded) or stops
    assert server_error("Request for unknown model: 'mm_qa' has no available versions").status == 503
    assert server_error("in ensemble 'mm_qa', Server is stopping, scheduler for model has stopped accepting new "
                        "inference requests").status == 503
    assert server_error("Model postprocess - Error when running inference: Server not ready").status == 503


# ---------------------------------------------------------------- the app over a fake mm_qa

class FakeMmQa:
    """Answers "A B C ..." one word per response (or at once), after `delay` seconds per response;
    `fail` raises ServerError after that many responses."""

    def __init__(self):
        self.delay, self.fail, self.words = 0.0, None, ["A", " B", " C", " D"]
        self.requests, self.ended = [], []  # per request: "finished" or "cancelled"
        self.ended_event = threading.Event()

    async def generate(self, model, inputs):
        self.requests.append((model, inputs))
        end = "cancelled"
        try:
            n = len(self.words)
            for i, word in enumerate(self.words if inputs["stream"] else ["".join(self.words)]):
                await asyncio.sleep(self.delay)
                if self.fail is not None and i >= self.fail:
                    raise ServerError(self.fail_message)
                last = not inputs["stream"] or i == n - 1
                yield {"text_output": word, "input_token_count": 9, "output_token_count": n if last else i + 1,
                       "finish_reason": "length" if last else "", "visual_tokens_kept": []}
            end = "finished"
        finally:
            self.ended.append(end)
            self.ended_event.set()

    async def ready(self, model):
        return model == "mm_qa"

    async def close(self):
        pass


@pytest.fixture()
def fake():
    return FakeMmQa()


@pytest.fixture()
def frontend(fake):
    with OpenAIFrontend(port=serve.free_port(), app=create_app(fake)) as f:
        yield f


@pytest.fixture()
def client(frontend):
    return openai.OpenAI(base_url=frontend.url, api_key="none", max_retries=0)


def test_models_lists_the_ready_ones(client):
    assert [m.id for m in client.models.list()] == ["mm_qa"]
    assert client.models.retrieve("mm_qa").id == "mm_qa"
    for absent in ("mm_qa_bls", "gpt-4o"):  # not ready, and not served
        with pytest.raises(openai.NotFoundError):
            client.models.retrieve(absent)


def test_non_streamed_answer_and_usage(client, fake):
    r = client.chat.completions.create(model="mm_qa", messages=[user("q")], max_tokens=4)
    assert r.choices[0].message.content == "A B C D" and r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (9, 4, 13)
    assert fake.requests == [("mm_qa", {"text_input": "q", "max_tokens": 4, "stream": False})]


def test_streamed_answer_chunks_then_usage_then_done(client, frontend):
    chunks = list(client.chat.completions.create(model="mm_qa", messages=[user("q")], stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "A B C D"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 4
    with httpx.stream("POST", frontend.url + "/chat/completions",
                      json={"model": "mm_qa", "messages": [user("q")], "stream": True}) as r:
        events = [line for line in r.iter_lines() if line]
    assert r.headers["content-type"].startswith("text/event-stream") and events[-1] == "data: [DONE]"


@pytest.mark.parametrize("message, error", [
    ("in ensemble 'mm_qa', image_decode: image 0: cannot decode", openai.BadRequestError),
    ("mm_qa_bls: internal error: RuntimeError('boom')", openai.InternalServerError),
])
def test_an_error_before_the_first_token_is_an_http_error(client, fake, message, error):
    fake.fail, fake.fail_message = 0, message
    for stream in (False, True):
        with pytest.raises(error, match="image 0: cannot decode|boom"):
            r = client.chat.completions.create(model="mm_qa", messages=[user("q")], stream=stream)
            list(r) if stream else None


def test_an_error_mid_stream_is_the_last_event(client, fake):
    fake.fail, fake.fail_message = 2, "the server is shutting down"
    got = []
    with pytest.raises(openai.APIError, match="shutting down"):
        for c in client.chat.completions.create(model="mm_qa", messages=[user("q")], stream=True):
            got.append(c)
    assert "".join(c.choices[0].delta.content or "" for c in got) == "A B"


def test_bad_json_and_unknown_paths_answer_in_openai_s_shape(frontend):
    r = httpx.post(frontend.url + "/chat/completions", content=b"{nope")
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = httpx.get(frontend.url + "/completions")
    assert r.status_code == 404 and r.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("stream", [False, True])
def test_busy_is_a_503_with_retry_after_which_the_openai_client_retries(frontend, fake, stream):
    fake.fail, fake.fail_message = 0, BUSY
    r = httpx.post(frontend.url + "/chat/completions", json={"model": "mm_qa", "messages": [user("q")],
                                                             "stream": stream})
    assert (r.status_code, r.headers["retry-after"], r.json()["error"]["message"]) == (503, "1", BUSY)
    patient = openai.OpenAI(base_url=frontend.url, api_key="none", max_retries=1)
    with pytest.raises(openai.InternalServerError, match="server busy"):
        patient.chat.completions.create(model="mm_qa", messages=[user("q")])
    assert len(fake.requests) == 3  # the httpx request, then the openai client's request and its one retry


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_disconnects_cancels_its_request(frontend, fake, stream):
    fake.delay = 0.2 if stream else 120  # the whole answer takes far longer than the client waits
    fake.words = [f" w{i}" for i in range(200)]
    body = {"model": "mm_qa", "messages": [user("q")], "stream": stream}
    if stream:  # gone after the first tokens
        with httpx.stream("POST", frontend.url + "/chat/completions", json=body) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
    else:  # gone while it waits for the whole answer
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(frontend.url + "/chat/completions", json=body, timeout=0.5)
    assert fake.ended_event.wait(30)
    assert fake.ended == ["cancelled"]
