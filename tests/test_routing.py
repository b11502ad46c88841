"""Adapter-affinity routing: stable, balanced, and only a removed instance's adapters move."""

from __future__ import annotations

from collections import Counter

import pytest

from manylora.client.routing import instance_order, pick_instance

INSTANCES = [f"10.0.0.{i}:8001" for i in range(4)]
ADAPTERS = [f"tenant-{i}" for i in range(4000)]


def test_same_adapter_same_instance_and_roughly_balanced():
    first = {a: pick_instance(a, INSTANCES) for a in ADAPTERS}
    assert first == {a: pick_instance(a, list(reversed(INSTANCES))) for a in ADAPTERS}  # order-independent
    counts = Counter(first.values())
    assert set(counts) == set(INSTANCES)
    assert max(counts.values()) < 1.2 * len(ADAPTERS) / len(INSTANCES)


def test_removing_an_instance_moves_only_its_adapters():
    before = {a: pick_instance(a, INSTANCES) for a in ADAPTERS}
    gone = INSTANCES[2]
    after = {a: pick_instance(a, [i for i in INSTANCES if i != gone]) for a in ADAPTERS}
    moved = {a for a in ADAPTERS if before[a] != after[a]}
    assert moved == {a for a in ADAPTERS if before[a] == gone}


def test_unhealthy_instances_are_skipped_in_preference_order():
    order = instance_order("tenant-7", INSTANCES)
    assert pick_instance("tenant-7", INSTANCES, healthy=lambda i: i != order[0]) == order[1]
    with pytest.raises(RuntimeError):
        pick_instance("tenant-7", INSTANCES, healthy=lambda i: False)
