"""Resolvers: find an adapter that a request names but the catalogue does not hold.

Off unless configured. Each source is offline and confined to its root: names are
validated, absolute paths and ``..`` are refused, and a path whose real location (after
symlinks) leaves the source is refused. More sources plug in as ``plugin:module:factory``.

    resolvers = "dir:/srv/adapters,hf-cache:/root/.cache/huggingface/hub,plugin:mypkg.s3:make"
"""

from __future__ import annotations

import importlib
import logging
import os
import re
from pathlib import Path
from typing import Protocol

log = logging.getLogger("manylora.resolvers")

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
REQUIRED_FILES = ("adapter_config.json", "adapter_model.safetensors")


class AdapterResolver(Protocol):
    """Maps an adapter name to a PEFT adapter directory, or None when this source lacks it."""

    def resolve(self, name: str) -> Path | None: ...


def _inside(path: Path, root: Path) -> bool:
    try:
        path.resolve(strict=True).relative_to(root.resolve(strict=True))
        return True
    except (OSError, ValueError):
        return False


def _checked_dir(candidate: Path, root: Path) -> Path | None:
    """candidate if it is an adapter directory whose files all lie inside root."""
    if not candidate.is_dir() or not _inside(candidate, root):
        return None
    for name in REQUIRED_FILES:
        f = candidate / name
        if not f.is_file():
            return None
        if not _inside(f, root):
            log.warning("resolver refused %s: %s points outside %s", candidate, name, root)
            return None
    return candidate


class LocalDirectoryResolver:
    """``<root>/<name>/`` holding adapter_config.json and adapter_model.safetensors."""

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root)

    def resolve(self, name: str) -> Path | None:
        if not NAME.match(name) or name in (".", ".."):
            return None
        return _checked_dir(self.root / name, self.root)


class HuggingFaceCacheResolver:
    """A local Hugging Face hub cache: ``org--repo`` -> ``models--org--repo/snapshots/<rev>/``.

    The revision is the one ``refs/main`` names, else the only snapshot there is.
    Snapshot files are symlinks into the repo's ``blobs/``; they must stay in that repo.
    """

    def __init__(self, cache_dir: str | os.PathLike) -> None:
        self.cache_dir = Path(cache_dir)

    def resolve(self, name: str) -> Path | None:
        if not NAME.match(name) or "--" not in name:
            return None
        repo = self.cache_dir / f"models--{name}"
        if not repo.is_dir() or not _inside(repo, self.cache_dir):
            return None
        snapshots = repo / "snapshots"
        ref = repo / "refs" / "main"
        if ref.is_file():
            revision = ref.read_text().strip()
            if not re.fullmatch(r"[0-9a-f]{7,64}", revision):
                return None
            candidate = snapshots / revision
        else:
            found = [p for p in snapshots.iterdir() if p.is_dir()] if snapshots.is_dir() else []
            if len(found) != 1:
                return None
            candidate = found[0]
        return _checked_dir(candidate, repo)


def load_resolver(spec: str) -> AdapterResolver:
    """One resolver from ``dir:PATH``, ``hf-cache:PATH`` or ``plugin:MODULE:FACTORY[:ARG]``."""
    kind, _, rest = spec.partition(":")
    if kind == "dir" and rest:
        return LocalDirectoryResolver(rest)
    if kind == "hf-cache" and rest:
        return HuggingFaceCacheResolver(rest)
    if kind == "plugin" and rest:
        module, _, factory = rest.partition(":")
        factory, _, arg = factory.partition(":")
        make = getattr(importlib.import_module(module), factory)
        resolver = make(arg) if arg else make()
        if not callable(getattr(resolver, "resolve", None)):
            raise ValueError(f"resolver plugin {module}:{factory} made {resolver!r}, which has no resolve(name)")
        return resolver
    raise ValueError(f"resolver '{spec}' not understood; use dir:PATH, hf-cache:PATH or plugin:MODULE:FACTORY[:ARG]")


def load_resolvers(specs: str) -> list[AdapterResolver]:
    return [load_resolver(s.strip()) for s in specs.split(",") if s.strip()]
