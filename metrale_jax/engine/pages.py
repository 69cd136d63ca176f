"""The host side of the paged KV cache: a page allocator and a page table per sequence row.

The device holds, per layer, a pool `[N, ps, 2K, D]` of N pages of `ps` positions (see
`models/paged_attention.py`). Which pages a sequence owns is host data: row `b` of the page
table `[B, PPS] int32` lists its pages in order (position p lives in page `table[b, p // ps]`),
and every compiled step reads the table as an argument, so allocating a page never compiles.

Page 0 is the null page: never handed out; unused table entries point at it, and writes of
padding tokens and idle rows land there. Every page carries a reference count (1 for a page
one sequence owns), so the prefix cache can later share a full page between sequences: a page
returns to the pool when its last reference goes.

Allocation is deterministic (a LIFO free list), so processes that replay the same calls hold
the same tables (multi-host).
"""

from __future__ import annotations

import numpy as np


class PageTable:
    """Pages of a pool of `num_pages` (page 0 reserved) held by `max_slots` sequence rows.

    Args:
        num_pages: N, the pool size including the null page (>= 2).
        page_size: ps, positions per page.
        max_slots: B, sequence rows.
        max_len: the longest sequence; PPS = ceil(max_len / ps) table columns.
    Attributes:
        table: [B, PPS] int32, row b's pages in order (0 = none); read it, don't write it.
        lengths: [B] int64, the positions each row's pages cover (a multiple of ps).
    """

    def __init__(self, num_pages: int, page_size: int, max_slots: int, max_len: int):
        if num_pages < 2:
            raise ValueError("a page pool needs at least 2 pages (page 0 is reserved)")
        self.num_pages = num_pages
        self.page_size = page_size
        self.max_slots = max_slots
        self.pages_per_seq = -(-max_len // page_size)
        self.table = np.zeros((max_slots, self.pages_per_seq), np.int32)
        self.owned = np.zeros(max_slots, np.int64)  # pages held by each row
        self.refcount = np.zeros(num_pages, np.int32)
        self.refcount[0] = 1  # the null page is never free
        self._free = list(range(num_pages - 1, 0, -1))  # pop() hands out 1, 2, 3, ...

    @property
    def free_pages(self) -> int:
        """Pages in the pool that no sequence holds."""
        return len(self._free)

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
        if need > len(self._free):
            return False
        have = int(self.owned[slot])
        for j in range(have, have + need):
            page = self._free.pop()
            self.refcount[page] = 1
            self.table[slot, j] = page
        self.owned[slot] = have + need
        return True

    def release(self, slot: int) -> int:
        """Drops row `slot`'s pages (each returns to the pool when no one else holds it);
        returns how many went back to the pool."""
        returned = 0
        for j in range(int(self.owned[slot]) - 1, -1, -1):
            page = int(self.table[slot, j])
            self.refcount[page] -= 1
            if self.refcount[page] == 0:
                self._free.append(page)
                returned += 1
        self.table[slot] = 0
        self.owned[slot] = 0
        return returned

    def release_all(self) -> None:
        """Every row's pages back to the pool."""
        for slot in range(self.max_slots):
            if self.owned[slot]:
                self.release(slot)

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
        assert not free[0], "the null page is in the free list"
        assert len(set(self._free)) == len(self._free), "a page is free twice"
        assert np.all(refs[free] == 0), "a free page is in a table"
        assert np.array_equal(refs[~free], self.refcount[~free]), "reference counts drifted"
        assert np.all(self.refcount[~free] > 0), "a page is lost (neither free nor held)"
