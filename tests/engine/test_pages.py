"""The host page allocator: pages per row, the null page, reference counts, determinism."""

from __future__ import annotations

import numpy as np
import pytest

from metrale_jax.engine.pages import PageTable


def test_rows_get_the_pages_their_length_needs_and_give_them_back():
    t = PageTable(num_pages=9, page_size=4, max_slots=3, max_len=16)
    assert t.pages_per_seq == 4 and t.free_pages == 8 and t.usable_pages == 8
    assert t.ensure(0, 5)  # positions 0..4: two pages
    assert t.owned[0] == 2 and t.free_pages == 6
    assert t.ensure(0, 8) and t.owned[0] == 2  # still two pages
    assert t.ensure(0, 9) and t.owned[0] == 3
    assert t.ensure(1, 16) and t.owned[1] == 4 and t.free_pages == 1
    assert 0 not in t.table[0, :3] and 0 not in t.table[1]
    assert set(t.table[0, :3]).isdisjoint(t.table[1])
    assert t.shortfall(2, 8) == 2
    assert not t.ensure(2, 8)  # too few: nothing changes
    assert t.owned[2] == 0 and t.free_pages == 1
    t.check()
    assert t.release(1) == 4 and t.free_pages == 5 and not t.table[1].any()
    t.release_all()
    assert t.free_pages == 8
    t.check()


def test_allocation_is_deterministic():
    def run() -> np.ndarray:
        t = PageTable(num_pages=20, page_size=2, max_slots=4, max_len=16)
        rng = np.random.default_rng(3)
        for _ in range(50):
            slot = int(rng.integers(4))
            if rng.random() < 0.3:
                t.release(slot)
            else:
                t.ensure(slot, int(rng.integers(1, 17)))
        t.check()
        return t.table.copy()
    assert np.array_equal(run(), run())


def test_a_shared_page_returns_only_with_its_last_reference():
    t = PageTable(num_pages=4, page_size=2, max_slots=2, max_len=4)
    assert t.ensure(0, 2)
    page = int(t.table[0, 0])
    t.table[1, 0] = page  # another row refers to the same page (a prefix-cache hit)
    t.owned[1] = 1
    t.refcount[page] += 1
    t.check()
    assert t.release(0) == 0 and t.free_pages == 2
    assert t.release(1) == 1 and t.free_pages == 3
    t.check()


def test_a_pool_needs_the_null_page_and_one_more():
    with pytest.raises(ValueError):
        PageTable(num_pages=1, page_size=4, max_slots=1, max_len=4)
