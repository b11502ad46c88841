"""The tritonserver flags the manylora models need, and the ones that close Triton's administrative APIs.

Any tritonserver of the supported version serves a rendered repository with its own command line; these are
the flags that line needs beyond ``--model-repository`` (docs/deployment.md lists them with their reasons).
scripts/serve.py starts the server with the same flags.
"""

from __future__ import annotations

import re

# Each Python-backend stub starts with a 4 MiB shared-memory region and grows it 1 MiB at a time: a request of
# a few thousand tokens fits the first region, so the common case never waits on a resize.
PYTHON_BACKEND_FLAGS = (
    "--backend-config=python,shm-default-byte-size=4194304",
    "--backend-config=python,shm-growth-byte-size=1048576",
)
# Triton's APIs that no tenant needs: registering shared-memory regions (the Python backend's own among them),
# loading and unloading models, configs (they hold server paths), per-model statistics, log and trace settings
ADMIN_APIS = ("shared-memory", "model-repository", "model-config", "statistics", "logging", "trace")
ADMIN_HEADER = "manylora-admin-key"
_KEY_CHARACTERS = re.compile(r"[A-Za-z0-9._~-]+")


def listen_flags(address: str = "127.0.0.1", http_port: int = 8000, grpc_port: int = 8001,
                 metrics_port: int = 8002) -> list[str]:
    """HTTP, gRPC and metrics endpoints on ``address`` (loopback unless chosen otherwise)."""
    return [
        f"--http-address={address}",
        f"--http-port={http_port}",
        f"--grpc-address={address}",
        f"--grpc-port={grpc_port}",
        f"--metrics-address={address}",
        f"--metrics-port={metrics_port}",
    ]


def restriction_flags(key: str, open_apis: tuple[str, ...] = ()) -> list[str]:
    """tritonserver flags that restrict ADMIN_APIS (less ``open_apis``; ``all`` opens every one) to requests that
    carry the header ADMIN_HEADER with ``key``."""
    unknown = sorted(set(open_apis) - set(ADMIN_APIS) - {"all"})
    if unknown:
        raise ValueError(f"--open-apis: unknown API(s) {unknown}; restricted ones are {', '.join(ADMIN_APIS)} (or all)")
    if "all" in open_apis:
        return []
    restricted = ",".join(api for api in ADMIN_APIS if api not in open_apis)
    if not restricted:
        return []
    if not _KEY_CHARACTERS.fullmatch(key):
        raise ValueError("the admin key may hold only letters, digits and ._~- (it travels in a header)")
    return [f"--http-restricted-api={restricted}:{ADMIN_HEADER}={key}",
            f"--grpc-restricted-protocol={restricted}:{ADMIN_HEADER}={key}"]
