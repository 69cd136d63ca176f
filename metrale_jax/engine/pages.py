"""The host side of the paged KV cache: a page allocator and a page table per sequence row.

The device holds, per layer, a pool `[N, ps, 2K, D]` of N pages of `ps` positions (see
`models/paged_attention.py`). Which pages a sequence owns is host data: row `b` of the page
table `[B, PPS] int32` lists its pages in order (position p lives in page `table[b, p // ps]`),
and every compiled step reads the table as an argument, so allocating a page never compiles.

Page 0 is the null page: never handed out; unused table entries point at it, and writes of
padding tokens and idle rows land there. Every page carries a reference count: the rows that
hold it. With a prefix cache (`engine/prefix_cache.py`) full pages get content keys; a row
takes cached pages with `attach` (the prefix it shares), and a cached page whose last row lets
go stays cached, idle, until the pool needs it: `free_pages` counts the free and the idle
pages, and allocation takes free pages first, then evicts the least recently released idle
page. A page in use is never evicted. Only full pages are shared, and a row writes only the
positions past its shared prefix, so a shared page is never written.

Allocation is deterministic (a LIFO free list), so processes that replay the same calls hold
the same tables (multi-host).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from metrale_jax.engine.prefix_cache import PrefixCache


class PageTable:
    """Pages of a pool of `num_pages` (page 0 reserved) held by `max_slots` sequence rows.

    Args:
        num_pages: N, the pool size including the null page (>= 2).
        page_size: ps, positions per page.
        max_slots: B, sequence rows.
        max_len: the longest sequence; PPS = ceil(max_len / ps) table columns.
        cache: the prefix cache's index of these pages (None: no page is ever shared).
    Attributes:
        table: [B, PPS] int32, row b's pages in order (0 = none); read it, don't write it.
        lengths: [B] int64, the positions each row's pages cover (a multiple of ps).
    """

    def __init__(self, num_pages: int, page_size: int, max_slots: int, max_len: int,
                 cache: PrefixCache | None = None):
        if num_pages < 2:
            raise ValueError("a page pool needs at least 2 pages (page 0 is reserved)")
        self.num_pages = num_pages
        self.page_size = page_size
        self.max_slots = max_slots
        self.pages_per_seq = -(-max_len // page_size)
        self.cache = cache
        self.table = np.zeros((max_slots, self.pages_per_seq), np.int32)
        self.owned = np.zeros(max_slots, np.int64)  # pages held by each row
        self.refcount = np.zeros(num_pages, np.int32)
        self.refcount[0] = 1  # the null page is never free
        self._free = list(range(num_pages - 1, 0, -1))  # pop() hands out 1, 2, 3, ...

    @property
    def free_pages(self) -> int:
        """Pages a row can get: those no sequence holds (free, or cached and idle)."""
        return len(self._free) + (len(self.cache.idle) if self.cache is not None else 0)

    @property
    def idle_pages(self) -> int:
        """Cached pages no sequence holds (evicted when the pool needs them)."""
        return len(self.cache.idle) if self.cache is not None else 0

    def _take(self) -> int:
        """A page for a row: a free one, else the least recently released idle one."""
        if self._free:
            return self._free.pop()
        return self.cache.evict()

    @property
    def usable_pages(self) -> int:
        """Pages a sequence can ever get: all but the null page."""
        return self.num_pages - 1

    def pages_for(self, length: int) -> int:
        """Pages that hold `length` positions."""
        return -(-length // self.page_size)

    def shortfall(self, slot: int, length: int) -> int:
        """Pages row `slot` still needs to hold `length` positions (0 when it has them)."""
        return max(0, self.pages_for(min(length, self.pages_per_seq * self.page_size))
                   - int(self.owned[slot]))

    def ensure(self, slot: int, length: int) -> bool:
        """Gives row `slot` the pages for `length` positions (capped at the table's width).
        Returns False, changing nothing, when the pool has too few free pages."""
        need = self.shortfall(slot, length)
        if need > self.free_pages:
            return False
        have = int(self.owned[slot])
        for j in range(have, have + need):
            page = self._take()
            self.refcount[page] = 1
            self.table[slot, j] = page
        self.owned[slot] = have + need
        return True

    def attach(self, slot: int, pages: list[int]) -> None:
        """Appends cached `pages` (a shared prefix) to row `slot`'s pages; an idle one leaves
        the LRU order. The row must hold only full pages before them."""
        have = int(self.owned[slot])
        if have + len(pages) > self.pages_per_seq:
            raise ValueError(f"row {slot} cannot hold {have + len(pages)} pages")
        for j, page in enumerate(pages, have):
            if self.refcount[page] == 0:
                self.cache.hold(page)
            self.refcount[page] += 1
            self.table[slot, j] = page
        self.owned[slot] = have + len(pages)

    def reuse_prefix(self, slot: int, keys: Sequence[str], budget: int, min_tokens: int) -> int:
        """Row `slot` shares the longest run of cached pages with `keys` (the content keys of
        its next full pages, from its first page not yet held; the row holds full pages
        only). At most `budget` of them may be idle pages (each one taken from the pool).
        A prefix shorter than `min_tokens` in all is not shared. Returns the pages attached
        (0 without a prefix cache)."""
        if self.cache is None or not keys:
            return 0
        hits = self.cache.lookup(keys)
        for i, page in enumerate(hits):
            if self.refcount[page] == 0:
                if budget <= 0:
                    hits = hits[:i]
                    break
                budget -= 1
        if (int(self.owned[slot]) + len(hits)) * self.page_size < min_tokens:
            return 0
        self.attach(slot, hits)
        return len(hits)

    def register(self, slot: int, first: int, keys: list[str]) -> int:
        """Caches row `slot`'s full pages `first, first + 1, ...` under `keys` (a page whose
        content is cached already stays the row's own). Returns how many were added."""
        if self.cache is None:
            return 0
        added = 0
        for j, key in enumerate(keys, first):
            if j >= self.owned[slot]:
                raise ValueError(f"row {slot} holds no page {j}")
            added += self.cache.add(int(self.table[slot, j]), key)
        return added

    def fork(self, moves: list[tuple[int, int, int]]) -> None:
        """Beam search: for each (dst, src, n), row dst drops its pages and holds the first
        n pages of row src as they were before the call (shared: each page's count rises;
        the rows write only past them). Every move reads the tables from before any of
        them, so rows may trade places."""
        taken = [self.table[src, :n].copy() for _, src, n in moves]
        for pages in taken:
            self.refcount[pages] += 1  # held through the releases below
        for dst, _, _ in moves:
            self.release(dst)
        for (dst, _, n), pages in zip(moves, taken, strict=True):
            self.table[dst, :n] = pages
            self.owned[dst] = n

    def release(self, slot: int) -> int:
        """Drops row `slot`'s pages (each returns to the pool when no one else holds it, a
        cached one as an idle page, its tail first in the LRU order); returns how many went
        back to the pool."""
        returned = 0
        for j in range(int(self.owned[slot]) - 1, -1, -1):
            page = int(self.table[slot, j])
            self.refcount[page] -= 1
            if self.refcount[page] == 0:
                if self.cache is not None and page in self.cache.keys:
                    self._free.extend(self.cache.park(page))
                else:
                    self._free.append(page)
                returned += 1
        self.table[slot] = 0
        self.owned[slot] = 0
        return returned

    def release_all(self) -> None:
        """Every row's pages back to the pool and the cache emptied (the pool's contents are
        gone): the table is as new."""
        self.table[:] = 0
        self.owned[:] = 0
        self.refcount[:] = 0
        self.refcount[0] = 1
        self._free = list(range(self.num_pages - 1, 0, -1))
        if self.cache is not None:
            self.cache.clear()

    def check(self) -> None:
        """Asserts the bookkeeping is consistent: every page is either free or referenced by
        as many rows as its count says (tests and debugging)."""
        refs = np.zeros(self.num_pages, np.int64)
        for slot in range(self.max_slots):
            for j in range(int(self.owned[slot])):
                refs[self.table[slot, j]] += 1
        refs[0] = 1
        free = np.zeros(self.num_pages, bool)
        free[self._free] = True
        idle = np.zeros(self.num_pages, bool)
        if self.cache is not None:
            idle[list(self.cache.idle)] = True
            assert not np.any(free & idle), "a page is both free and idle"
            assert all(page in self.cache.keys for page in self.cache.idle), \
                "an idle page has no key"
            assert all(self.cache.pages[k] == p for p, k in self.cache.keys.items()), \
                "the key index drifted"
            assert not np.any(free[list(self.cache.keys)]), "a free page has a key"
            assert len(self.cache.idle) <= self.cache.capacity, "the cache outgrew its share"
        assert not free[0], "the null page is in the free list"
        assert len(set(self._free)) == len(self._free), "a page is free twice"
        assert np.all(refs[free | idle] == 0), "a free or idle page is in a table"
        held = ~(free | idle)
        assert np.array_equal(refs[held], self.refcount[held]), "reference counts drifted"
        assert np.all(self.refcount[held] > 0), "a page is lost (neither free, idle nor held)"
        assert np.all(self.refcount[free | idle] == 0), "a free page has references"
