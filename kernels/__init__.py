"""Triton kernels, each beside a PyTorch reference with the same signature.

On a machine without CUDA the kernels run in Triton's interpreter (TRITON_INTERPRET=1, set here
before triton is first imported), so their tests also run in CPU-only CI; the engine itself only
calls them on CUDA and uses the references elsewhere.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
