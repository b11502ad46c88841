"""The operator's key for what tenants must not reach (Triton's admin APIs, the OpenAI front's adapter management):
given, else kept in a file made with a random key (mode 0600) on first use."""

from __future__ import annotations

import os
import secrets
from pathlib import Path


def operator_key(given: str | None, key_file: str | Path) -> str:
    """``given`` if set, else the key in ``key_file``; a missing or empty file gets a new random key first."""
    if given:
        return given
    path = Path(key_file)
    if path.is_file():
        key = path.read_text().strip()
        if key:
            return key
    path.parent.mkdir(parents=True, exist_ok=True)
    key = secrets.token_hex(32)  # hex: never starts with '-', so `--admin-key KEY` always parses
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(key + "\n")
    return key
