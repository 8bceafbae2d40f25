"""OpenAI chat completions <-> the mm_qa interface, without any I/O.

`parse_chat` checks a `/v1/chat/completions` body and maps it onto mm_qa's inputs
(`serving.interface.CLIENT_INPUTS`); `completion`, `chunk` and `usage_chunk` build the JSON the
client gets back from mm_qa's outputs; `OpenAIError` is an error in OpenAI's shape with its HTTP
status (and headers), and `server_error` classifies the message of an error that Triton sent.

mm_qa answers one question about a list of images, so a chat becomes one question: the text of
the last message (which must be the user's) is the question when it is the only message; otherwise
the system/developer messages' text comes first, then each earlier turn as "role: text", then the
last message's text, separated by blank lines. The images of every user message go to the model
in the order they appear; the chat template puts them all before the question.
"""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from ..image_input import image_bytes
from ..serving.errors import INTERNAL_ERROR, SERVER_BUSY, SHUTTING_DOWN, BadInput

ROLES = ("system", "developer", "user", "assistant")
FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length"}  # mm_qa's -> OpenAI's
# Extensions beyond OpenAI's parameters, named and typed as mm_qa's inputs (as vLLM takes top_k, ignore_eos
# and priority; mm_qa's priority is whether and how soon the keep ratio is lowered under load).
EXTENSIONS = {"top_k": int, "ignore_eos": bool, "visual_keep_ratio": float, "priority": int}
# Parameters that would change the answer in ways mm_qa cannot: refused unless at their default.
UNSUPPORTED = {"n": (None, 1), "logprobs": (None, False), "top_logprobs": (None, 0), "tools": (None, []),
               "functions": (None, []), "logit_bias": (None, {}), "frequency_penalty": (None, 0, 0.0),
               "presence_penalty": (None, 0, 0.0)}
# Triton's own words for a model it does not serve right now (an entry model unloaded while the server
# drains, `serve.TritonServer.drain`) or for a server that is stopping: 503, as our SHUTTING_DOWN.
UNAVAILABLE_PHRASES = ("has no available versions", "Server is stopping", "Server not ready")
# Retry-After of a busy refusal, in seconds: waiting requests are admitted as running ones finish, so
# the queue moves within seconds. The openai clients wait that long and retry a 503 (twice by default).
RETRY_AFTER_S = 1


class OpenAIError(Exception):
    """An error answered as OpenAI does: {"error": {"message", "type", "param", "code"}} with `status`."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 retry_after: int | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = {} if retry_after is None else {"retry-after": str(retry_after)}

    @property
    def body(self) -> dict:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


def server_error(message: str, unavailable: bool = False) -> OpenAIError:
    """An error Triton answered (or could not be reached, `unavailable`): the client's fault unless the
    server says otherwise (gRPC stream errors carry only a message; see serving.errors). Busy is 503,
    not 429: the server as a whole is overloaded, not this client over a quota of its own."""
    if SERVER_BUSY in message:  # nothing was generated: the same request may be sent again
        return OpenAIError(503, message, retry_after=RETRY_AFTER_S)
    if unavailable or any(phrase in message for phrase in (SHUTTING_DOWN, *UNAVAILABLE_PHRASES)):
        return OpenAIError(503, message)
    if INTERNAL_ERROR in message:
        return OpenAIError(500, message)
    return OpenAIError(400, message)


@dataclass
class ChatRequest:
    model: str
    inputs: dict  # mm_qa inputs by name (clients.triton_client takes them as keyword arguments)
    stream: bool = False
    include_usage: bool = False
    id: str = field(default_factory=lambda: f"chatcmpl-{uuid.uuid4().hex}")
    created: int = field(default_factory=lambda: int(time.time()))


def _bad(message: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param)


def _typed(body: dict, name: str, kind: type, check=None, must: str = "", bits: int = 32):
    """body[name] as `kind` (None when absent); ints are taken where a number is wanted, bools never.
    An int must fit a signed integer of `bits` (mm_qa's INT32 inputs, unless said otherwise)."""
    value = body.get(name)
    if value is None:
        return None
    number = kind is float and isinstance(value, int)
    if isinstance(value, bool) != (kind is bool) or not (isinstance(value, kind) or number):
        raise _bad(f"{name} must be {'a number' if kind is float else kind.__name__}, got {value!r}", name)
    if kind is int and not -2**(bits - 1) <= value < 2**(bits - 1):
        raise _bad(f"{name} must be a {bits}-bit signed integer, got {value!r}", name)
    if check is not None and not check(value):
        raise _bad(f"{name} must be {must}, got {value!r}", name)
    return kind(value)


def _text(value: str, param: str) -> str:
    """value, refused when it is no valid Unicode (a lone surrogate: JSON's \\ud800 escapes parse into one)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise _bad(f"not valid Unicode text: {e.reason} at character {e.start}", param) from None
    return value


def _image(part: dict, param: str) -> bytes:
    source = part.get("image_url")
    url = source.get("url") if isinstance(source, dict) else source
    if not isinstance(url, str):
        raise _bad("an image_url part needs image_url.url", param)
    url = _text(url, param)
    if url[:5].lower() != "data:":
        raise _bad("image_url.url must be a base64 data URL (data:image/png;base64,...): the server fetches "
                   "no URLs, it has no network access by default", param)
    if url[5:11].lower() != "image/":
        raise _bad(f"image_url.url must hold an image (data:image/...), got {url[:url.find(',')][:40]!r}", param)
    try:
        return image_bytes(url.encode("ascii"), "image_url")
    except (BadInput, UnicodeEncodeError) as e:
        raise _bad(f"{e}", param) from None


def _content(message: dict, i: int) -> tuple[str, list[bytes]]:
    """A message's text (its text parts joined by newlines) and images."""
    content, param = message.get("content"), f"messages[{i}].content"
    if content is None or isinstance(content, str):
        return _text(content or "", param), []
    if not isinstance(content, list):
        raise _bad("content must be a string or a list of content parts", param)
    texts, images = [], []
    for j, part in enumerate(content):
        if not isinstance(part, dict):
            raise _bad(f"a content part is an object with a type (text or image_url), got {part!r:.40}",
                       f"{param}[{j}]")
        kind = part.get("type")
        if kind == "text":
            if not isinstance(part.get("text"), str):
                raise _bad("a text part needs its text as a string: {\"type\": \"text\", \"text\": \"...\"}",
                           f"{param}[{j}].text")
            texts.append(_text(part["text"], f"{param}[{j}].text"))
        elif kind == "image_url" and message["role"] == "user":
            images.append(_image(part, f"{param}[{j}].image_url"))
        else:
            raise _bad(f"unsupported content part {kind!r} in a {message['role']} message "
                       "(text parts, and image_url parts in user messages)", f"{param}[{j}]")
    return "\n".join(texts), images


def _question(messages) -> tuple[str, list[bytes]]:
    if not isinstance(messages, list) or not messages:
        raise _bad("messages must be a non-empty list", "messages")
    system, turns, images = [], [], []
    for i, message in enumerate(messages):
        role = message.get("role") if isinstance(message, dict) else None
        if role not in ROLES:
            raise _bad(f"messages[{i}].role must be one of {', '.join(ROLES)}, got {role!r}", f"messages[{i}].role")
        text, found = _content(message, i)
        images += found
        (system if role in ("system", "developer") else turns).append((role, text))
    if messages[-1]["role"] != "user":
        raise _bad("the last message must be the user's question", f"messages[{len(messages) - 1}]")
    question = turns[-1][1]
    if not question.strip():
        raise _bad("the last user message has no text: ask a question", f"messages[{len(messages) - 1}].content")
    parts = [text for _, text in system if text] + [f"{role}: {text}" for role, text in turns[:-1]]
    return "\n\n".join(parts + [question]), images


def parse_chat(body, models) -> ChatRequest:
    """A /v1/chat/completions body -> the mm_qa request it asks for (OpenAIError when it cannot be served)."""
    if not isinstance(body, dict):
        raise _bad("the body must be a JSON object")
    model = body.get("model")
    if model is None:
        raise _bad("model is required", "model")
    if not isinstance(model, str):
        raise _bad(f"model must be a string, got {model!r}", "model")
    if model not in models:
        raise OpenAIError(404, f"the model {model!r} does not exist; this server has {', '.join(models)}",
                          "model", "model_not_found")
    for name, defaults in UNSUPPORTED.items():
        if body.get(name) not in defaults:
            raise _bad(f"{name} is not supported by this server", name)
    fmt = body.get("response_format")
    if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != "text"):
        raise _bad("only response_format {\"type\": \"text\"} is supported", "response_format")
    question, images = _question(body.get("messages"))
    inputs: dict = {"text_input": question}
    if images:
        inputs["images"] = images
    limit = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    sampling = {
        "max_tokens": _typed(body, limit, int, lambda v: v >= 1, "at least 1"),
        "temperature": _typed(body, "temperature", float, lambda v: 0 <= v <= 2, "in [0, 2]"),
        "top_p": _typed(body, "top_p", float, lambda v: 0 < v <= 1, "in (0, 1]"),
        # seed: int64, as vLLM takes it; mm_qa's random_seed (UINT64) is its bit pattern
        "random_seed": None if (seed := _typed(body, "seed", int, bits=64)) is None else seed % 2**64,
        **{name: _typed(body, name, kind) for name, kind in EXTENSIONS.items()},
    }
    inputs.update({k: v for k, v in sampling.items() if v is not None})
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else stop
    if stops is not None and not (isinstance(stops, list) and all(isinstance(s, str) for s in stops)):
        raise _bad("stop must be a string or a list of strings", "stop")
    if stops:
        inputs["stop_words"] = [_text(s, "stop") for s in stops]
    stream = _typed(body, "stream", bool) or False
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise _bad("stream_options must be an object", "stream_options")
    return ChatRequest(model, inputs, stream, bool(stream and options.get("include_usage")))


def _usage(final: dict) -> dict:
    prompt, completion_tokens = final.get("input_token_count") or 0, final.get("output_token_count") or 0
    return {"prompt_tokens": prompt, "completion_tokens": completion_tokens, "total_tokens": prompt + completion_tokens}


def _finish(final: dict) -> str | None:
    return FINISH_REASONS.get(final.get("finish_reason") or "")


def completion(chat: ChatRequest, answer: dict) -> dict:
    """The non-streamed answer: mm_qa's one response (stream=false) as a chat.completion."""
    return {"id": chat.id, "object": "chat.completion", "created": chat.created, "model": chat.model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": answer.get("text_output", "")},
                         "logprobs": None, "finish_reason": _finish(answer)}],
            "usage": _usage(answer)}


def chunk(chat: ChatRequest, delta: dict, finish_reason: str | None = None) -> dict:
    out = {"id": chat.id, "object": "chat.completion.chunk", "created": chat.created, "model": chat.model,
           "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]}
    if chat.include_usage:
        out["usage"] = None  # every chunk but the last carries usage null (OpenAI's shape)
    return out


def chunks(chat: ChatRequest, response: dict, first: bool) -> list[dict]:
    """The chunks of one streamed mm_qa response: the role with the first, then the text delta;
    the response that finishes also gets a chunk with the finish reason."""
    out = []
    if first:
        out.append(chunk(chat, {"role": "assistant", "content": ""}))
    if response.get("text_output"):
        out.append(chunk(chat, {"content": response["text_output"]}))
    if _finish(response) is not None:
        out.append(chunk(chat, {}, _finish(response)))
    return out


def usage_chunk(chat: ChatRequest, final: dict) -> dict:
    """stream_options.include_usage: the last chunk, with no choices and the request's usage."""
    return {"id": chat.id, "object": "chat.completion.chunk", "created": chat.created, "model": chat.model,
            "choices": [], "usage": _usage(final)}
