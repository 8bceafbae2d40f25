# Triton loads this file; the implementation lives in the zipmoe package (python_backends/models/postprocess.py).
from zipmoe.models.postprocess import TritonPythonModel  # noqa: F401
