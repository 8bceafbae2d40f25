# Triton loads this file; the implementation lives in the zipmoe package (python_backends/models/image_decode.py).
from zipmoe.models.image_decode import TritonPythonModel  # noqa: F401
