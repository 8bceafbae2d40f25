# Triton loads this file; the implementation lives in the zipmoe package (python_backends/models/preprocess.py).
from zipmoe.models.preprocess import TritonPythonModel  # noqa: F401
