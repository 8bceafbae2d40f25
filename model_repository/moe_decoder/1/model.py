# Triton loads this file; the implementation lives in the zipmoe package (python_backends/models/moe_decoder.py).
from zipmoe.models.moe_decoder import TritonPythonModel  # noqa: F401
