# Triton loads this file; the implementation lives in the zipmoe package (python_backends/models/mm_qa_bls.py).
from zipmoe.models.mm_qa_bls import TritonPythonModel  # noqa: F401
