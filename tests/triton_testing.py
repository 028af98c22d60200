"""What the Triton kernel tests share: where the kernels run. On CPU they run through Triton's interpreter
(``TRITON_INTERPRET=1``, set here before triton is imported, as conftest does); with ``CTA_TEST_GPU=1`` on CUDA."""

import os

os.environ.setdefault("TRITON_INTERPRET", "0" if os.environ.get("CTA_TEST_GPU") else "1")

import pytest  # noqa: E402
import torch  # noqa: E402

ON_GPU = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") in ("", "0")
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
DEVICE = "cuda" if ON_GPU else "cpu"
gpu = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU with TRITON_INTERPRET unset (CTA_TEST_GPU=1)")
needs_kernels = pytest.mark.skipif(
    not (ON_GPU or INTERPRET), reason="needs CUDA or TRITON_INTERPRET=1 set before triton is imported"
)
