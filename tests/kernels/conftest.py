"""Kernel tests run under Triton's interpreter on the CPU unless told otherwise.

TRITON_INTERPRET is set here, before any test module imports triton. To run the same tests
compiled on a GPU, start pytest with TRITON_INTERPRET=0: tensors are then made on "cuda".
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402


def kernel_device() -> str:
    interpret = os.environ.get("TRITON_INTERPRET", "1").strip().lower() in ("1", "true", "on", "yes")
    if interpret:
        return "cpu"
    if not torch.cuda.is_available():
        pytest.skip("TRITON_INTERPRET=0 needs a GPU", allow_module_level=True)
    return "cuda"


@pytest.fixture(scope="session")
def device() -> str:
    return kernel_device()
