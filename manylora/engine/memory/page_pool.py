"""A pool of fixed-size pages with owners: who holds which page, and what is free.

The pool only does bookkeeping (page ids); the tensors that pages index live with
their users (the KV cache). Every mutation checks the invariants it relies on.
"""

from __future__ import annotations

from collections import deque


class PoolExhausted(Exception):
    """Asked for more pages than are free."""


class PagePool:
    """Page ids 0..num_pages-1, each free or held by exactly one owner."""

    def __init__(self, num_pages: int) -> None:
        if num_pages <= 0:
            raise ValueError(f"a page pool needs at least one page, got {num_pages}")
        self.num_pages = num_pages
        self._free: deque[int] = deque(range(num_pages))
        self._owner_of: dict[int, object] = {}
        self._pages_of: dict[object, list[int]] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, owner: object, n: int) -> list[int]:
        """Give ``owner`` n more pages; their ids, in order."""
        if n > len(self._free):
            raise PoolExhausted(f"asked for {n} pages, {len(self._free)} of {self.num_pages} free")
        pages = [self._free.popleft() for _ in range(n)]
        for page in pages:
            assert page not in self._owner_of, f"page {page} is free and owned at once"
            self._owner_of[page] = owner
        self._pages_of.setdefault(owner, []).extend(pages)
        return pages

    def free(self, owner: object) -> int:
        """Return every page ``owner`` holds; how many."""
        pages = self._pages_of.pop(owner, [])
        for page in pages:
            assert self._owner_of.pop(page) is owner, f"page {page} freed by a non-owner"
            self._free.append(page)
        return len(pages)

    def pages_of(self, owner: object) -> list[int]:
        return list(self._pages_of.get(owner, ()))

    def owners(self) -> list[object]:
        return list(self._pages_of)

    def check(self) -> None:
        """Assert the invariants: each page free xor owned, owners' lists match."""
        free = set(self._free)
        assert len(free) == len(self._free), "a page is on the free list twice"
        owned = set(self._owner_of)
        assert not free & owned, "a page is free and owned"
        assert free | owned == set(range(self.num_pages)), "a page is neither free nor owned"
        listed = [p for pages in self._pages_of.values() for p in pages]
        assert len(listed) == len(set(listed)) == len(owned), "an owned page is listed twice or not at all"
