"""The ASGI app of the OpenAI-compatible API: `/v1/models` (and `/v1/models/{model}`) and `/v1/chat/completions`.

A chat request comes in as JSON, `chat.parse_chat` maps it onto mm_qa's inputs, and the request
goes to Triton over one gRPC stream (`TritonBackend`, tritonclient's asyncio client); mm_qa's
responses go back to the client as one chat.completion, or as server-sent events (`data: {chunk}`
... `data: [DONE]`) when it asked to stream. Triton's errors before the first token become an HTTP
error in OpenAI's shape; later ones an error event. While a request runs, the app watches the
client's connection: a disconnect (waiting for the first token or between tokens) cancels the gRPC
stream, which cancels the mm_qa request in Triton.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from typing import AsyncIterator, Protocol

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ..clients.triton_client import ServerError, ServerUnavailable, grpc_generate_async
from .chat import ChatRequest, OpenAIError, chunks, completion, parse_chat, server_error, usage_chunk

# The Triton models with the client interface (serving/interface.py): a chat request's `model`.
CLIENT_MODELS = ("mm_qa", "mm_qa_bls")
log = logging.getLogger("zipmoe.openai")


class Backend(Protocol):
    def generate(self, model: str, inputs: dict) -> AsyncIterator[dict]: ...  # mm_qa's responses
    async def ready(self, model: str) -> bool: ...
    async def close(self) -> None: ...


class TritonBackend:
    """mm_qa over Triton's gRPC stream; one channel, opened on the app's event loop at first use."""

    def __init__(self, url: str):
        self.url = url
        self._client = None

    @property
    def client(self):
        if self._client is None:
            import tritonclient.grpc.aio as grpcclient

            self._client = grpcclient.InferenceServerClient(self.url)
        return self._client

    def generate(self, model: str, inputs: dict) -> AsyncIterator[dict]:
        return grpc_generate_async(self.client, model, **inputs)

    async def ready(self, model: str) -> bool:
        try:
            return await self.client.is_model_ready(model)
        except Exception:  # tritonclient raises its own exception for an unreachable server
            return False

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()


class ClientGone(Exception):
    """The HTTP client disconnected before its answer was complete."""


async def _until_disconnected(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _watched(responses: AsyncIterator[dict], gone: asyncio.Future) -> AsyncIterator[dict]:
    """`responses` until they end, or ClientGone as soon as the client disconnects while one is awaited
    (cancelling the wait closes `responses`, which cancels its gRPC stream)."""
    while True:
        following = asyncio.ensure_future(anext(responses))
        await asyncio.wait({following, gone}, return_when=asyncio.FIRST_COMPLETED)
        if not following.done():
            following.cancel()
            await asyncio.gather(following, return_exceptions=True)
            raise ClientGone()
        try:
            response = following.result()
        except StopAsyncIteration:
            return
        yield response


def _event(payload) -> bytes:
    return b"data: " + (payload if isinstance(payload, bytes) else json.dumps(payload).encode()) + b"\n\n"


class ChatResponse(Response):
    """Answers one parsed chat request (the whole exchange with the client, errors included)."""

    def __init__(self, backend: Backend, chat: ChatRequest):
        super().__init__()
        self.backend, self.chat = backend, chat

    async def __call__(self, scope, receive, send) -> None:
        chat = self.chat
        gone = asyncio.ensure_future(_until_disconnected(receive))
        responses = self.backend.generate(chat.model, {**chat.inputs, "stream": chat.stream})
        streaming = False  # the SSE headers are sent
        try:
            answers = _watched(responses, gone)
            first = await anext(answers, None)
            if first is None:
                raise OpenAIError(500, "mm_qa ended the request without an answer")
            if not chat.stream:
                async for _ in answers:  # the final flag (stream=false sends the answer in one response)
                    pass
                await _send(send, 200, "application/json", json.dumps(completion(chat, first)).encode())
                return
            streaming = True
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]})
            last = first
            for payload in chunks(chat, first, first=True):
                await send({"type": "http.response.body", "body": _event(payload), "more_body": True})
            async for last in answers:
                for payload in chunks(chat, last, first=False):
                    await send({"type": "http.response.body", "body": _event(payload), "more_body": True})
            if chat.include_usage:
                await send({"type": "http.response.body", "body": _event(usage_chunk(chat, last)), "more_body": True})
            await send({"type": "http.response.body", "body": _event(b"[DONE]")})
        except ClientGone:
            log.info("%s: the client disconnected; its request was cancelled", chat.id)
        except (OpenAIError, ServerError) as e:
            error = e if isinstance(e, OpenAIError) else server_error(str(e), isinstance(e, ServerUnavailable))
            if streaming:  # headers went out already: the error is the stream's last event
                await send({"type": "http.response.body", "body": _event(error.body) + _event(b"[DONE]")})
            else:
                await _send(send, error.status, "application/json", json.dumps(error.body).encode(), error.headers)
        finally:
            gone.cancel()
            await responses.aclose()


async def _send(send, status: int, content_type: str, body: bytes, headers: dict[str, str] | None = None) -> None:
    headers = {"content-type": content_type, **(headers or {})}
    await send({"type": "http.response.start", "status": status,
                "headers": [(k.encode(), v.encode()) for k, v in headers.items()]})
    await send({"type": "http.response.body", "body": body})


def _error(error: OpenAIError) -> JSONResponse:
    return JSONResponse(error.body, status_code=error.status)


def create_app(backend: Backend, models: tuple[str, ...] = CLIENT_MODELS) -> Starlette:
    created = int(time.time())

    def card(model: str) -> dict:
        return {"id": model, "object": "model", "created": created, "owned_by": "zipmoe"}

    async def list_models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [card(m) for m in models if await backend.ready(m)]})

    async def retrieve_model(request: Request) -> Response:
        model = request.path_params["model"]
        if model not in models or not await backend.ready(model):
            return _error(OpenAIError(404, f"the model {model!r} does not exist or is not ready; this server has "
                                           f"{', '.join(models)}", "model", "model_not_found"))
        return JSONResponse(card(model))

    async def chat_completions(request: Request) -> Response:
        try:
            body = json.loads(await request.body())
        except ValueError as e:
            return _error(OpenAIError(400, f"the body is not valid JSON: {e}"))
        try:
            return ChatResponse(backend, parse_chat(body, models))
        except OpenAIError as e:
            return _error(e)

    async def http_error(request: Request, exc: HTTPException) -> Response:
        return _error(OpenAIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}"))

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        await backend.close()

    routes = [Route("/v1/models", list_models), Route("/v1/models/{model}", retrieve_model),
              Route("/v1/chat/completions", chat_completions, methods=["POST"])]
    return Starlette(routes=routes, exception_handlers={HTTPException: http_error}, lifespan=lifespan)
