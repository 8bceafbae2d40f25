# Triton loads this file; the implementation lives in the zipmoe package (python_backends/models/vision_encoder.py).
from zipmoe.models.vision_encoder import TritonPythonModel  # noqa: F401
