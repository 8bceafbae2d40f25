"""Errors a request can end with; the Triton adapters turn each into a TritonError for the client."""


class BadInput(ValueError):
    """A client error: the message names the problem; the server keeps serving."""


class ModelError(RuntimeError):
    """A composed model answered with an error; its message (naming the model) goes to the client."""


# gRPC stream errors carry only a message, so clients (the OpenAI frontend) tell a failure that is not
# the client's (answered 500, or 503 while shutting down) from bad input (400) by these phrases.
INTERNAL_ERROR = "internal error"
SHUTTING_DOWN = "the server is shutting down"


def internal_error(where: str, error: BaseException) -> str:
    """The client's message for a bug or a broken device in `where`."""
    return f"{where}: {INTERNAL_ERROR}: {error!r}"
