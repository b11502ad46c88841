"""Kernel tests run under Triton's interpreter on the CPU unless told otherwise.

TRITON_INTERPRET is set here, before any test module imports triton. To run the same tests
compiled on a GPU, start pytest with TRITON_INTERPRET=0: tensors are then made on "cuda".
Interpreted, every kernel launch of every test checks its memory accesses against its tensor
arguments (memory_bounds.py): what would be an illegal memory access on the GPU fails the test (and, with
MANYLORA_POISON_EMPTY=1, ../conftest.py fills every torch.empty first, as stale GPU memory).
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402


def kernel_device() -> str:
    if _interpreting():
        return "cpu"
    if not torch.cuda.is_available():
        pytest.skip("TRITON_INTERPRET=0 needs a GPU", allow_module_level=True)
    return "cuda"


@pytest.fixture(scope="session")
def device() -> str:
    return kernel_device()


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "1").strip().lower() in ("1", "true", "on", "yes")


@pytest.fixture(autouse=True)
def _memory_accesses_in_bounds():
    """Out-of-bounds loads, stores and atomics fail the test (the interpreter would read the host heap instead)."""
    if not _interpreting():
        yield
        return
    from memory_bounds import bounds_checked

    with bounds_checked():
        yield
