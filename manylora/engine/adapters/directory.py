"""The adapters a request may name: the catalogue, the resolvers behind it, and the operator's runtime updates.

Every error is a RequestError naming the adapter: NOT_FOUND for a name neither the catalogue nor a resolver
knows (saying why for a catalogue entry refused at startup), INVALID_ARG for a file that does not fit the base,
UNSUPPORTED for updates while the operator has them off. What it reports of an adapter leaves out server paths
unless the operator shows them (EngineConfig.list_adapter_paths): any tenant may list adapters.
"""

from __future__ import annotations

import logging

from manylora.engine.adapters.catalogue import AdapterCatalogue, RefusedAdapter
from manylora.engine.adapters.resolvers import AdapterResolver
from manylora.engine.adapters.spec import AdapterSpec
from manylora.engine.errors import AdapterError, ErrorCode, RequestError

log = logging.getLogger("manylora.engine")


def adapter_info(spec: AdapterSpec, status: str = "ready", show_path: bool = False) -> dict:
    """What the load / unload / list calls report of one adapter version."""
    info = {"name": spec.name, "status": status, "rank": spec.rank, "target_modules": list(spec.target_modules),
            "sha256": spec.sha256, "layers": len(spec.layers)}
    if show_path:
        info["path"] = spec.path
    return info


def refused_info(refused: RefusedAdapter, show_path: bool = False) -> dict:
    """What the list call reports of a catalogue entry refused at startup."""
    info = {"name": refused.name, "status": "refused", "reason": refused.reason}
    if show_path and refused.path is not None:
        info["path"] = refused.path
    return info


class AdapterDirectory:
    """Name -> registered adapter version, for admission and for the operator's load / unload calls."""

    def __init__(self, catalogue: AdapterCatalogue, resolvers: list[AdapterResolver],
                 allow_runtime_updates: bool, show_paths: bool = False) -> None:
        self.catalogue = catalogue
        self.resolvers = resolvers
        self.allow_runtime_updates = allow_runtime_updates
        self.show_paths = show_paths

    def resolve(self, name: str) -> AdapterSpec:
        """The registered version of an adapter, asking the resolvers (if any) about unknown names."""
        try:
            return self.catalogue.resolve(name)
        except RequestError:
            for resolver in self.resolvers:
                path = resolver.resolve(name)
                if path is None:
                    continue
                try:
                    spec = self.catalogue.register(name, path)
                except AdapterError as e:
                    if name in self.catalogue:  # a concurrent request resolved it first
                        return self.catalogue.get(name)
                    raise RequestError(ErrorCode.INVALID_ARG, str(e)) from None
                log.info("resolved adapter '%s' to %s", name, path)
                return spec
            raise

    def _check_runtime_updates(self) -> None:
        if not self.allow_runtime_updates:
            raise RequestError(ErrorCode.UNSUPPORTED,
                               "runtime adapter updates are off; the operator enables them with "
                               "MANYLORA_ALLOW_RUNTIME_ADAPTERS=1")

    def load(self, name: str, path: str, sha256: str | None = None, replace: bool = False) -> dict:
        """Register (or, with replace, re-version) an adapter while serving. Requests admitted
        before a replace finish on the version they were admitted with."""
        self._check_runtime_updates()
        if name in self.catalogue and not replace:
            raise RequestError(ErrorCode.ALREADY_EXISTS,
                               f"adapter '{name}' is already registered; unload it first or pass replace")
        try:
            spec = (self.catalogue.replace if replace else self.catalogue.register)(name, path, sha256)
        except AdapterError as e:
            raise RequestError(ErrorCode.INVALID_ARG, str(e)) from None
        log.info("adapter '%s' %s from %s (sha256 %s)", name, "replaced" if replace else "loaded", path, spec.sha256)
        return adapter_info(spec, show_path=self.show_paths)

    def unload(self, name: str) -> dict:
        """Unregister an adapter: new requests get NOT_FOUND, admitted ones finish on their version."""
        self._check_runtime_updates()
        try:
            spec = self.catalogue.unregister(name)
        except KeyError:
            raise RequestError(ErrorCode.NOT_FOUND, f"unknown adapter '{name}'; nothing to unload") from None
        log.info("adapter '%s' unloaded (sha256 %s)", name, spec.sha256)
        return adapter_info(spec, "unloaded", self.show_paths)

    def list(self) -> list[dict]:
        """Every registered adapter ("status": "ready") and catalogue entry refused at startup ("status":
        "refused", with the reason), by name."""
        ready = [adapter_info(spec, show_path=self.show_paths) for spec in self.catalogue.specs()]
        refused = [refused_info(r, self.show_paths) for r in self.catalogue.refused()]
        return sorted(ready + refused, key=lambda info: info["name"])
