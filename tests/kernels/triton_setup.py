"""Set-up shared by the kernel tests; import it before anything that imports Triton.

On a machine without CUDA the kernels run through Triton's interpreter: ``TRITON_INTERPRET=1``
must be set before Triton is first imported, and the interpreter needs numpy. Tests of big
grids run only on CUDA (``cuda_only``): the interpreter is too slow for them.
"""

from __future__ import annotations

import os

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="triton is not installed")
pytest.importorskip("numpy", reason="the Triton interpreter needs numpy")

DEVICE = torch.device("cuda" if CUDA else "cpu")
cuda_only = pytest.mark.skipif(
    not CUDA, reason="runs only on CUDA (too slow in the Triton interpreter)"
)
