"""Errors a request can end with; the Triton adapters turn each into a TritonError for the client."""


class BadInput(ValueError):
    """A client error: the message names the problem; the server keeps serving."""


class ModelError(RuntimeError):
    """A composed model answered with an error; its message (naming the model) goes to the client."""


class StreamLost(RuntimeError):
    """A decoder stream that ended before its first response. moe_decoder answers every request at
    least once (its final response), so the call's responses went astray on their way back in server
    2.51's Python backend stub (seen in bursts of refusals). By the stub's code, a call's iterator
    is emptied so only when another call's first response comes back under the same id
    (pb_stub.cc, GetResponseIterator); how that happens is not known. Nothing reached the client
    yet, so the pipeline may ask again."""


class ServerBusy(RuntimeError):
    """Too many requests wait, or one waited too long: refused before it produced anything, so the
    client may retry it later. The adapters answer it with Triton's UNAVAILABLE code (HTTP 503)."""


# gRPC stream errors carry only a message, so clients (the OpenAI frontend) tell a failure that is not
# the client's (answered 500, or 503 while shutting down or busy) from bad input (400) by these phrases.
INTERNAL_ERROR = "internal error"
SHUTTING_DOWN = "the server is shutting down"
SERVER_BUSY = "server busy"


def internal_error(where: str, error: BaseException) -> str:
    """The client's message for a bug or a broken device in `where`."""
    return f"{where}: {INTERNAL_ERROR}: {error!r}"


def server_busy(why: str) -> ServerBusy:
    """The busy error, `why` naming the limit reached and the setting that sets it."""
    return ServerBusy(f"{SERVER_BUSY}: {why}; retry later")
