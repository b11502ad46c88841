"""The adapter catalogue: adapter name -> validated :class:`AdapterSpec`, safe to share between threads.

The catalogue file has the shape of vLLM's ``--lora-modules`` / the vLLM Triton backend's
``multi_lora.json``: a JSON object ``{"name": "/path/to/peft/adapter", ...}``. A value may also be
``{"path": "...", "sha256": "<hex>"}`` to pin the exact weights file; a mismatch refuses the adapter.

Registered leniently (``register_all(strict=False)``, the engine's default), a bad entry is refused alone: the
catalogue remembers it with the reason (:class:`RefusedAdapter`), and requests naming it get NOT_FOUND saying why,
until the name is registered successfully.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from manylora.engine.adapters.spec import AdapterSpec, parse_adapter_spec
from manylora.engine.errors import AdapterError, ErrorCode, RequestError
from manylora.engine.model_config import ModelConfig

log = logging.getLogger("manylora.catalogue")

MAX_NAME_LENGTH = 128
_NAME_RE = re.compile(r"[A-Za-z0-9._-]+")
_SHA256_RE = re.compile(r"[0-9a-f]{64}")
# Names listed in a NOT_FOUND message at most.
_LIST_AT_MOST = 10


class CatalogueError(AdapterError):
    """A catalogue file that cannot be read; the message names the file and the reason."""

    def __init__(self, path: str, reason: str) -> None:
        Exception.__init__(self, f"adapter catalogue '{path}': {reason}")
        self.adapter = path
        self.reason = reason


@dataclass(frozen=True)
class CatalogueEntry:
    """One catalogue value: the adapter directory and, optionally, the pinned sha256 of its weights."""

    path: str
    sha256: str | None = None


@dataclass(frozen=True)
class RefusedAdapter:
    """A catalogue entry that ``register_all(strict=False)`` refused.

    Attributes:
        name: the adapter's name in the catalogue.
        path: its directory as the catalogue gives it; None if the entry itself was malformed.
        reason: why it was refused, the directory written as ``<adapter dir>``: tenants read it (in listings and
            in their requests' errors), and only the operator may choose to show them server paths.
    """

    name: str
    path: str | None
    reason: str


def _without_path(reason: str, path: str | None) -> str:
    return reason.replace(path, "<adapter dir>") if path else reason


def validate_adapter_name(name: object) -> str:
    """Return ``name`` if it is a usable adapter name, else raise :class:`AdapterError` saying why.

    Names are non-empty, at most 128 characters of ``[A-Za-z0-9._-]``, and do not start with '.'
    (so that a name can never be a path such as ``..`` or ``../x``).
    """
    if not isinstance(name, str):
        raise AdapterError(repr(name), f"adapter name must be a string, got {type(name).__name__}")
    if not name:
        raise AdapterError(name, "adapter name must not be empty")
    if len(name) > MAX_NAME_LENGTH:
        raise AdapterError(name[:40] + "...", f"adapter name is {len(name)} characters; at most {MAX_NAME_LENGTH}")
    if not _NAME_RE.fullmatch(name):
        raise AdapterError(name, "adapter name may contain only letters, digits, '.', '_' and '-'")
    if name.startswith("."):
        raise AdapterError(name, "adapter name must not start with '.'")
    return name


def _normalise_sha256(name: str, value: object) -> str:
    if not isinstance(value, str) or not _SHA256_RE.fullmatch(value.lower()):
        raise AdapterError(name, f"pinned sha256 must be 64 hex digits, got {value!r}")
    return value.lower()


def load_catalogue_file(path: str | Path) -> dict[str, CatalogueEntry]:
    """Read a catalogue JSON file: name -> :class:`CatalogueEntry`, in file order.

    Values are a path string or ``{"path": ..., "sha256": ...}``; relative paths resolve against the
    catalogue file's directory, ``~`` is expanded. Raises :class:`CatalogueError` for an unreadable
    file and :class:`AdapterError` for a bad name or value (naming the adapter).
    """
    cat_path = Path(path)
    try:
        text = cat_path.read_text(encoding="utf-8")
    except FileNotFoundError as e:
        raise CatalogueError(str(cat_path), "file not found") from e
    except (OSError, UnicodeDecodeError) as e:
        raise CatalogueError(str(cat_path), f"cannot read: {e}") from e
    try:
        raw = json.loads(text, object_pairs_hook=_no_duplicate_keys)
    except json.JSONDecodeError as e:
        raise CatalogueError(str(cat_path), f"not valid JSON ({e})") from e
    except ValueError as e:  # duplicate names
        raise CatalogueError(str(cat_path), str(e)) from e
    if not isinstance(raw, dict):
        raise CatalogueError(
            str(cat_path), f'must hold a JSON object {{"name": "/path/to/adapter", ...}}, got {type(raw).__name__}'
        )
    base_dir = cat_path.parent
    out: dict[str, CatalogueEntry] = {}
    for name, value in raw.items():
        validate_adapter_name(name)
        out[name] = _entry_from_value(name, value, base_dir)
    return out


def _no_duplicate_keys(pairs: list[tuple[str, object]]) -> dict[str, object]:
    out: dict[str, object] = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"adapter name '{k}' appears twice")
        out[k] = v
    return out


def _entry_from_value(name: str, value: object, base_dir: Path | None) -> CatalogueEntry:
    """A catalogue value (path string, dict with path/sha256, or CatalogueEntry) as a CatalogueEntry."""
    sha: str | None = None
    if isinstance(value, CatalogueEntry):
        raw_path, sha = value.path, value.sha256
    elif isinstance(value, str | os.PathLike):
        raw_path = os.fspath(value)
    elif isinstance(value, dict):
        unknown = sorted(set(value) - {"path", "sha256"})
        if unknown:
            raise AdapterError(name, f"unknown catalogue fields {unknown}; allowed: path, sha256")
        raw_path = value.get("path")
        sha = value.get("sha256")
    else:
        raise AdapterError(name, f'catalogue value must be a path or {{"path": ..., "sha256": ...}}, got {value!r}')
    if not isinstance(raw_path, str) or not raw_path:
        raise AdapterError(name, f"catalogue entry needs a non-empty 'path' string, got {raw_path!r}")
    if sha is not None:
        sha = _normalise_sha256(name, sha)
    p = Path(raw_path).expanduser()
    if not p.is_absolute() and base_dir is not None:
        p = base_dir / p
    return CatalogueEntry(path=str(p), sha256=sha)


class AdapterCatalogue:
    """Registered adapters by name; every method is safe to call from several threads."""

    def __init__(self, model_config: ModelConfig, max_lora_rank: int) -> None:
        if max_lora_rank < 1:
            raise ValueError(f"max_lora_rank must be >= 1, got {max_lora_rank}")
        self.model_config = model_config
        self.max_lora_rank = max_lora_rank
        self._specs: dict[str, AdapterSpec] = {}
        self._refused: dict[str, RefusedAdapter] = {}
        self._lock = threading.Lock()

    def _parse(self, name: str, path: str | Path, pinned_sha256: str | None) -> AdapterSpec:
        """Validate one adapter (no lock held: it reads files)."""
        validate_adapter_name(name)
        if pinned_sha256 is not None:
            pinned_sha256 = _normalise_sha256(name, pinned_sha256)
        spec = parse_adapter_spec(name, Path(path).expanduser(), self.model_config, self.max_lora_rank)
        if pinned_sha256 is not None and spec.sha256 != pinned_sha256:
            raise AdapterError(
                name,
                f"sha256 mismatch: the catalogue pins {pinned_sha256}, {spec.weights_path} has {spec.sha256}",
            )
        return spec

    def _add(self, spec: AdapterSpec) -> None:
        """Insert under the lock; a name is registered once (and no longer counts as refused)."""
        existing = self._specs.get(spec.name)
        if existing is not None:
            raise AdapterError(spec.name, f"already registered (from {existing.path})")
        self._specs[spec.name] = spec
        self._refused.pop(spec.name, None)

    def register(self, name: str, path: str | Path, pinned_sha256: str | None = None) -> AdapterSpec:
        """Validate and add one adapter; raises :class:`AdapterError` (name + reason) when refused."""
        spec = self._parse(name, path, pinned_sha256)
        with self._lock:
            self._add(spec)
        return spec

    def replace(self, name: str, path: str | Path, pinned_sha256: str | None = None) -> AdapterSpec:
        """Register a new version under an existing (or new) name; requests admitted earlier keep
        the version they were admitted with (the engine holds their spec)."""
        spec = self._parse(name, path, pinned_sha256)
        with self._lock:
            self._specs[name] = spec
            self._refused.pop(name, None)
        return spec

    def unregister(self, name: str) -> AdapterSpec:
        """Remove a name; new requests for it get NOT_FOUND. Raises KeyError if unknown."""
        with self._lock:
            spec = self._specs.pop(name, None)
        if spec is None:
            raise KeyError(f"unknown adapter '{name}'")
        return spec

    def register_all(
        self,
        mapping: Mapping[str, str | os.PathLike | CatalogueEntry | dict],
        *,
        strict: bool = True,
        workers: int = 4,
    ) -> dict[str, AdapterError]:
        """Register many adapters (values as in :func:`load_catalogue_file`; relative paths as given).

        Adapters are validated on ``workers`` threads (hashing releases the GIL). With ``strict``
        the first bad adapter in ``mapping`` order raises its :class:`AdapterError` and none of
        the batch is registered; otherwise bad adapters are skipped, each logged as a warning and
        remembered as refused (:meth:`refused`), and returned as name -> error.
        """
        items = list(mapping.items())
        results: list[tuple[str | None, AdapterSpec | AdapterError]] = []  # (adapter directory, outcome)

        def one(item: tuple[str, object]) -> tuple[str | None, AdapterSpec | AdapterError]:
            name, value = item
            path = None
            try:
                validate_adapter_name(name)
                entry = _entry_from_value(name, value, None)
                path = entry.path
                return path, self._parse(name, entry.path, entry.sha256)
            except AdapterError as e:
                return path, e

        if workers > 1 and len(items) > 1:
            with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="adapter-register") as pool:
                results = list(pool.map(one, items))
        else:
            results = [one(item) for item in items]

        errors: dict[str, AdapterError] = {}
        with self._lock:
            if strict:
                for (name, _), (_, res) in zip(items, results, strict=True):
                    if isinstance(res, AdapterError):
                        raise res
                    if name in self._specs:
                        raise AdapterError(name, f"already registered (from {self._specs[name].path})")
            for (name, _), (path, res) in zip(items, results, strict=True):
                if isinstance(res, AdapterError):
                    errors[name] = res
                    log.warning("adapter '%s' (%s) refused; the other adapters are served: %s", name, path, res.reason)
                    if name not in self._specs:  # a registered version goes on serving
                        self._refused[name] = RefusedAdapter(name, path, _without_path(res.reason, path))
                    continue
                try:
                    self._add(res)
                except AdapterError as e:
                    errors[name] = e
        return errors

    def get(self, name: str) -> AdapterSpec:
        """The spec of a registered adapter; raises KeyError naming the adapter otherwise."""
        with self._lock:
            spec = self._specs.get(name)
        if spec is None:
            raise KeyError(f"unknown adapter '{name}'")
        return spec

    def resolve(self, name: str) -> AdapterSpec:
        """The spec of a registered adapter, or RequestError(NOT_FOUND): why, for a refused adapter, or else
        listing (some) registered names."""
        with self._lock:
            spec = self._specs.get(name)
            if spec is None:
                known = sorted(self._specs)
                refused = self._refused.get(name)
        if spec is not None:
            return spec
        if refused is not None:
            raise RequestError(ErrorCode.NOT_FOUND, f"adapter '{name}' was refused at startup: {refused.reason}")
        if not known:
            raise RequestError(ErrorCode.NOT_FOUND, f"unknown adapter '{name}'; no adapters are registered")
        listed = ", ".join(known[:_LIST_AT_MOST])
        more = len(known) - _LIST_AT_MOST
        suffix = f" (and {more} more)" if more > 0 else ""
        raise RequestError(ErrorCode.NOT_FOUND, f"unknown adapter '{name}'; registered: {listed}{suffix}")

    def names(self) -> list[str]:
        """Registered names, sorted."""
        with self._lock:
            return sorted(self._specs)

    def specs(self) -> list[AdapterSpec]:
        """Registered specs, sorted by name."""
        with self._lock:
            return [self._specs[n] for n in sorted(self._specs)]

    def refused(self) -> list[RefusedAdapter]:
        """The entries register_all refused whose names have not been registered since, sorted by name."""
        with self._lock:
            return [self._refused[n] for n in sorted(self._refused)]

    def __len__(self) -> int:
        with self._lock:
            return len(self._specs)

    def __contains__(self, name: object) -> bool:
        with self._lock:
            return name in self._specs
