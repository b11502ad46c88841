"""The Python backend's shared-memory regions of one tritonserver: named apart, removed once the server is gone.

Each Python-backend stub talks to its server through a region in /dev/shm named ``<prefix><uuid>`` (tritonserver
2.51; the prefix is ``triton_python_backend_shm_region_`` unless ``--backend-config=python,shm-region-prefix-name``
sets it). A server that stops unlinks its regions; one that is killed, or whose stubs are, leaves them behind, 4 MiB
or more each, until the machine (or the container's /dev/shm) goes. A prefix of its own per server lets whoever
started it remove exactly its regions once it has exited, and none of a server still running beside it.
"""

from __future__ import annotations

import re
import secrets
from pathlib import Path

SHM_DIR = Path("/dev/shm")
FLAG = "--backend-config=python,shm-region-prefix-name="
TRITON_DEFAULT_PREFIX = "triton_python_backend_shm_region_"
_OWN_PREFIX = re.compile(r"manylora_[0-9a-f]{12}_")


def new_prefix() -> str:
    """A region prefix no other server on this machine uses."""
    return f"manylora_{secrets.token_hex(6)}_"


def is_own_prefix(prefix: str) -> bool:
    """Whether ``prefix`` is one new_prefix() makes: only such a prefix names one server's regions alone (an
    operator's own, or Triton's default, may be shared by other servers on the machine)."""
    return bool(_OWN_PREFIX.fullmatch(prefix))


def prefix_flag(prefix: str) -> str:
    """The tritonserver flag that names a server's regions ``<prefix><uuid>``."""
    return FLAG + prefix


def prefix_of(cmd: list[str]) -> str | None:
    """The region prefix a tritonserver command line sets (the last one counts), or None where it sets none."""
    given = [part[len(FLAG):] for part in cmd if part.startswith(FLAG)]
    return given[-1] if given else None


def regions_of(prefix: str, directory: Path = SHM_DIR) -> list[Path]:
    """The regions named with ``prefix`` in ``directory``."""
    if not prefix:
        raise ValueError("an empty prefix would name every file in the directory")
    if not directory.is_dir():
        return []
    return sorted(path for path in directory.iterdir() if path.name.startswith(prefix))


def remove_regions(prefix: str, directory: Path = SHM_DIR) -> list[str]:
    """Unlink the regions ``prefix`` names (call it once their server has exited: a stub still running keeps its
    mapping, but a server still running would lose the name); returns the names removed."""
    removed = []
    for path in regions_of(prefix, directory):
        try:
            path.unlink()
        except FileNotFoundError:
            continue
        removed.append(path.name)
    return removed


def remove_server_regions(cmd: list[str]) -> list[str]:
    """Once the server ``cmd`` started has exited: unlink the regions it left (it was killed, or its stubs were),
    where its command line names them with a prefix of its own (is_own_prefix); returns the names removed."""
    prefix = prefix_of(cmd)
    return remove_regions(prefix) if prefix and is_own_prefix(prefix) else []
