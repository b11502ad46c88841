"""Switches for the whole suite.

MANYLORA_POISON_EMPTY=1: every Python-level ``torch.empty`` (and empty_like, empty_strided, new_empty) of every
test is filled with NaN / a huge index first, as stale GPU memory would be (``poison_empty.py``): code that reads
memory it never wrote (a KV page's tail, a table's padding, a skipped row) then fails here instead of on a GPU.
The unified pool, zeros when made, starts as NaN too: on a serving GPU its pages hold whatever the adapters and
sequences that had them before left.
"""

import os

import pytest


@pytest.fixture(autouse=True)
def _poisoned_empty_memory():
    if os.environ.get("MANYLORA_POISON_EMPTY") != "1":
        yield
        return
    from poison_empty import poison, poisoned_empty

    from manylora.engine.memory import unified_pool

    made = unified_pool.UnifiedPool.__init__

    def poisoned_pool(self, *args, **kwargs):
        made(self, *args, **kwargs)
        poison(self.storage)

    unified_pool.UnifiedPool.__init__ = poisoned_pool
    try:
        with poisoned_empty():
            yield
    finally:
        unified_pool.UnifiedPool.__init__ = made
