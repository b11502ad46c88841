"""Adapter-affinity routing across server instances (one instance per GPU, each with its own pool).

Send all of an adapter's requests to the instance that already holds it: rendezvous
(highest-random-weight) hashing picks, for each adapter, an order of instances that
stays put when instances come and go (only the adapters of a removed instance move).
The first healthy instance of that order serves the request.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence


def _weight(adapter: str, instance: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{adapter}\0{instance}".encode(), digest_size=8).digest(), "big")


def instance_order(adapter: str | None, instances: Sequence[str]) -> list[str]:
    """Every instance, most preferred first, for an adapter (None: the base model)."""
    key = adapter or ""
    return sorted(instances, key=lambda inst: _weight(key, inst), reverse=True)


def pick_instance(adapter: str | None, instances: Sequence[str],
                  healthy: Callable[[str], bool] = lambda _inst: True) -> str:
    """The instance for this adapter's request: its first healthy one in rendezvous order."""
    if not instances:
        raise ValueError("no instances to route to")
    for inst in instance_order(adapter, instances):
        if healthy(inst):
            return inst
    raise RuntimeError(f"no healthy instance among {list(instances)} for adapter '{adapter}'")
