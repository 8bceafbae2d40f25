"""Clients of the `mm_qa` interface: gRPC streaming and HTTP (`generate` / `generate_stream`).

Each call yields one dict per server response: `text_output` (the text delta when streaming,
the whole answer otherwise), `input_token_count`, `output_token_count`, `finish_reason`,
`visual_tokens_kept` and `visual_keep_ratio_used` (serving/interface.py CLIENT_OUTPUTS).
Images go as file bytes over gRPC and as base64 text in HTTP's JSON (the server decodes both).
An error the server answers raises ServerError; an overloaded server's refusal, ServerBusy.
"""
from __future__ import annotations

import asyncio
import base64
import json
import queue
import urllib.error
import urllib.request
from typing import AsyncIterator, Iterator

import numpy as np

from zipmoe.serving.errors import SERVER_BUSY
from zipmoe.serving.interface import CLIENT_INPUTS, CLIENT_OUTPUTS

# STRING inputs take lists of str/bytes.
LIST_INPUTS = {name for name, spec in CLIENT_INPUTS.items() if spec.is_list}
LIST_OUTPUTS = {name for name, spec in CLIENT_OUTPUTS.items() if spec.is_list}


class ServerError(RuntimeError):
    """The server answered the request with an error."""


class ServerUnavailable(ServerError):
    """The server could not be reached, or the connection broke."""


class ServerBusy(ServerError):
    """The server refused the request for overload before generating anything: retry it later."""


def _server_error(message: str) -> ServerError:
    # Server 2.51 shows clients no error code here (gRPC streams carry only a message, and HTTP
    # generate's status is unreliable: see models/io.py error_response), so busy is known by its phrase.
    return (ServerBusy if SERVER_BUSY in message else ServerError)(message)


def _array(name: str, value) -> np.ndarray:
    if name not in CLIENT_INPUTS:
        raise ValueError(f"mm_qa has no input {name!r}; it takes {', '.join(CLIENT_INPUTS)}")
    dtype = CLIENT_INPUTS[name].numpy_dtype
    values = list(value) if name in LIST_INPUTS else [value]
    if dtype is np.object_:
        values = [v if isinstance(v, bytes) else str(v).encode("utf-8") for v in values]
    elif np.issubdtype(dtype, np.integer):  # numpy < 2 wraps an integer out of range without a word
        limits = np.iinfo(dtype)
        if not all(limits.min <= int(v) <= limits.max for v in values):
            raise ValueError(f"{name} must be in [{limits.min}, {limits.max}], got {value}")
    return np.asarray(values, dtype=dtype)


def _decode(outputs: dict) -> dict:
    result = {}
    for name, arr in outputs.items():
        if name in LIST_OUTPUTS:
            result[name] = arr.reshape(-1).tolist()
            continue
        v = arr.reshape(-1)[0] if arr.size else None
        result[name] = v.decode("utf-8") if isinstance(v, bytes) else (None if v is None else v.item())
    return result


def _grpc_tensors(inputs: dict) -> list:
    from tritonclient.grpc import InferInput

    tensors = []
    for name, value in inputs.items():
        arr = _array(name, value)
        t = InferInput(name, list(arr.shape), CLIENT_INPUTS[name].dtype)
        t.set_data_from_numpy(arr)
        tensors.append(t)
    return tensors


def _grpc_response(result, error) -> tuple[dict | None, bool]:
    """One stream message -> (its outputs, or None for the empty final response; whether it is the
    last). An error message from the server raises ServerError."""
    if error is not None:
        raise _server_error(str(error))
    response = result.get_response()
    final = response.parameters.get("triton_final_response")
    outputs = _decode({o.name: result.as_numpy(o.name) for o in response.outputs}) if response.outputs else None
    return outputs, final is not None and final.bool_param


def grpc_generate(url: str, model: str = "mm_qa", timeout: float = 300, outputs: list[str] | None = None,
                  client=None, **inputs) -> Iterator[dict]:
    """Streams responses over gRPC (bidirectional stream; works for stream=True and False); `outputs`
    names the outputs to return (None: all of them). client: a tritonclient.grpc.InferenceServerClient
    to open the stream on, kept open afterwards (one channel for many requests, as perf_analyzer
    keeps); None: a channel of this request's own."""
    import tritonclient.grpc as grpcclient

    own = client is None
    client = grpcclient.InferenceServerClient(url) if own else client
    results: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    finished = False
    wanted = None if outputs is None else [grpcclient.InferRequestedOutput(name) for name in outputs]
    try:
        client.async_stream_infer(model, _grpc_tensors(inputs), outputs=wanted, enable_empty_final_response=True)
        while not finished:
            result, error = results.get(timeout=timeout)
            finished = error is not None  # an error ends the request on the server's side
            outputs, finished = _grpc_response(result, error)
            if outputs is not None:
                yield outputs
    finally:
        # Cancel only a request still running (the caller stopped reading): cancelling one that has
        # already finished can leave the ensemble's bookkeeping stuck at server shutdown (2.51).
        client.stop_stream(cancel_requests=not finished)
        if own:
            client.close()


async def grpc_generate_async(client, model: str = "mm_qa", **inputs) -> AsyncIterator[dict]:
    """grpc_generate on asyncio, over `client`, a tritonclient.grpc.aio.InferenceServerClient (one
    channel for many requests). Closing the iteration early, or cancelling the task awaiting it,
    cancels the gRPC stream, and with it the request on the server."""
    import grpc

    done = asyncio.Event()

    async def request():
        yield {"model_name": model, "inputs": _grpc_tensors(inputs),
               "parameters": {"triton_enable_empty_final_response": True}}
        await done.wait()  # keep the stream open until the last response: then it ends cleanly

    stream = client.stream_infer(request())
    finished = False  # the server ended the request: its last response, an error, or a broken stream
    try:
        while not finished:
            try:
                result, error = await stream.__anext__()
            except grpc.aio.AioRpcError as e:  # no server, or the stream broke
                finished = True
                raise ServerUnavailable(f"Triton's gRPC stream failed: {e.code().name}: {e.details()}") from None
            except StopAsyncIteration:
                finished = True
                raise ServerUnavailable("Triton closed the gRPC stream before the last response") from None
            finished = error is not None
            outputs, finished = _grpc_response(result, error)
            if outputs is not None:
                yield outputs
    finally:
        done.set()
        if not finished:  # see grpc_generate: only a request still running
            stream.cancel()


def _http_body(inputs: dict) -> bytes:
    body = {}
    for name, value in inputs.items():
        arr = _array(name, value)
        if name == "images":  # JSON carries text: file bytes as base64
            items = [base64.b64encode(v).decode("ascii") for v in arr]
        elif arr.dtype == np.object_:
            items = [v.decode("utf-8") for v in arr]
        else:
            items = arr.tolist()
        body[name] = items if name in LIST_INPUTS else items[0]
    return json.dumps(body).encode("utf-8")


def _http_result(obj: dict) -> dict:
    if "error" in obj:
        raise _server_error(obj["error"])
    return {k: (obj[k][0] if isinstance(obj.get(k), list) and k not in LIST_OUTPUTS else obj[k])
            for k in CLIENT_OUTPUTS if k in obj}


def _http_error(e: urllib.error.HTTPError) -> ServerError:
    """The error of a refused request: JSON from `generate`, a server-sent event from `generate_stream`."""
    body = e.read().strip()
    if body.startswith(b"data:"):
        body = body.split(b"\n", 1)[0][5:]
    try:
        message = json.loads(body or b"{}").get("error", str(e))
    except (ValueError, AttributeError):
        message = f"{e}: {body[:500].decode('utf-8', 'replace')}"
    return _server_error(message)


def http_generate(url: str, model: str = "mm_qa", timeout: float = 300, **inputs) -> dict:
    """One non-streamed answer through Triton's HTTP generate endpoint."""
    inputs = {**inputs, "stream": False}
    req = urllib.request.Request(f"http://{url}/v2/models/{model}/generate", data=_http_body(inputs),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return _http_result(json.loads(r.read()))
    except urllib.error.HTTPError as e:
        raise _http_error(e) from None


def http_generate_stream(url: str, model: str = "mm_qa", timeout: float = 300, **inputs) -> Iterator[dict]:
    """Server-sent events from Triton's HTTP generate_stream endpoint."""
    inputs = {**inputs, "stream": True}
    req = urllib.request.Request(f"http://{url}/v2/models/{model}/generate_stream", data=_http_body(inputs),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            for line in r:
                if line.startswith(b"data:"):
                    yield _http_result(json.loads(line[5:]))
    except urllib.error.HTTPError as e:
        raise _http_error(e) from None


def scrape_metrics(url: str) -> dict[str, float]:
    """zipmoe_* counters from the metrics endpoint, summed over labels."""
    totals: dict[str, float] = {}
    with urllib.request.urlopen(f"http://{url}/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("zipmoe_"):
                name, value = line.split("{")[0], float(line.rsplit(" ", 1)[1])
                totals[name] = totals.get(name, 0.0) + value
    return totals


def counter_deltas(before: dict[str, float], after: dict[str, float], names=None) -> dict[str, float]:
    """How much each counter grew between two `scrape_metrics` (names: these, absent ones as 0; None:
    every counter of `after`)."""
    return {name: after.get(name, 0.0) - before.get(name, 0.0) for name in (after if names is None else names)}
