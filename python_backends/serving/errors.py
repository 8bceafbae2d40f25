"""Errors a request can end with; the Triton adapters turn each into a TritonError for the client."""


class BadInput(ValueError):
    """A client error: the message names the problem; the server keeps serving."""


class ModelError(RuntimeError):
    """A composed model answered with an error; its message (naming the model) goes to the client."""
