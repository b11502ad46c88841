"""Which Python a Triton Python-backend stub was built for.

The stub (``triton_python_backend_stub``) embeds CPython through ``libpython3.X.so``: a packed environment must
hold that same 3.X, or the stub does not start (or starts on another Python's standard library). The stub's
dynamic section names the library it needs; this reads that name without running the stub.
"""

from __future__ import annotations

import re
from pathlib import Path

# where the NGC tritonserver images keep the stub
NGC_STUB = Path("/opt/tritonserver/backends/python/triton_python_backend_stub")
_LIBPYTHON = re.compile(rb"libpython(3\.\d+)\.so")


def stub_python_version(stub: Path | str) -> str:
    """The "3.X" of the libpython the stub at ``stub`` links; ValueError if it names none."""
    stub = Path(stub)
    data = stub.read_bytes()
    if not data.startswith(b"\x7fELF"):
        raise ValueError(f"{stub}: not an ELF executable")
    versions = sorted({m.group(1).decode() for m in _LIBPYTHON.finditer(data)})
    if len(versions) != 1:
        raise ValueError(f"{stub}: expected one libpython3.X.so among its libraries, found {versions or 'none'}")
    return versions[0]
