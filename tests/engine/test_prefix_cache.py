"""The prefix cache's host side: content keys, sharing, LRU eviction and page accounting."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from metrale_jax.engine.pages import PageTable
from metrale_jax.engine.prefix_cache import PrefixCache, page_keys, root_key

PS = 4


def table(num_pages: int = 9, slots: int = 4, max_len: int = 32, capacity: int | None = None):
    cache = PrefixCache(num_pages - 1 if capacity is None else capacity)
    return PageTable(num_pages, PS, slots, max_len, cache)


def test_a_pages_key_names_its_whole_prefix_and_root():
    root = root_key(None, None)
    a = page_keys(list(range(10)), PS, root)
    assert len(a) == 2  # two full pages; the partial third has no key
    # The same tokens give the same keys; computing them in parts gives the same chain.
    assert page_keys(list(range(12)), PS, root)[:2] == a
    assert page_keys(list(range(12)), PS, a[0], first=1, count=1) == a[1:]
    # A change in page 0 changes every later key; a change in page 1 keeps page 0's.
    b = page_keys([99, *list(range(1, 10))], PS, root)
    assert b[0] != a[0] and b[1] != a[1]
    c = page_keys([*list(range(4)), 99, *list(range(5, 10))], PS, root)
    assert c[0] == a[0] and c[1] != a[1]


def test_isolation_parts_give_different_roots():
    roots = {root_key(None, None), root_key("a", None), root_key("b", None),
             root_key("a", "salt"), root_key(None, "salt"), root_key("", None),
             root_key(None, ""), root_key("a\x00", None)}
    assert len(roots) == 8
    assert root_key("a", "s") == root_key("a", "s")
    tokens = list(range(8))
    assert page_keys(tokens, PS, root_key("a", None)) != page_keys(tokens, PS,
                                                                   root_key("b", None))


def test_shared_pages_are_refcounted_and_idle_ones_evicted_oldest_first():
    t = table()
    keys = page_keys(list(range(12)), PS, root_key())
    assert t.ensure(0, 12)
    assert t.register(0, 0, keys) == 3
    assert t.cache.lookup(keys) == [int(p) for p in t.table[0, :3]]
    # Row 1 shares the first two pages; they are held twice.
    t.attach(1, t.cache.lookup(keys[:2]))
    assert list(t.refcount[t.table[1, :2]]) == [2, 2]
    t.check()
    t.release(0)  # page 2 is idle now, pages 0 and 1 still held by row 1
    assert t.idle_pages == 1 and t.free_pages == t.usable_pages - 2
    t.check()
    t.release(1)  # released tail first: page 1 before page 0 in the LRU order
    assert t.idle_pages == 3 and t.free_pages == t.usable_pages
    order = list(t.cache.idle)
    assert order == [int(t.cache.pages[keys[2]]), int(t.cache.pages[keys[1]]),
                     int(t.cache.pages[keys[0]])]
    # Taking every free page, then one more, evicts the oldest idle page (the tail page).
    free = t.free_pages - t.idle_pages
    assert t.ensure(2, free * PS)
    t.check()
    assert len(t.cache) == 3
    assert t.ensure(2, (free + 1) * PS)
    assert keys[2] not in t.cache.pages and keys[0] in t.cache.pages
    assert t.cache.lookup(keys) == [t.cache.pages[keys[0]], t.cache.pages[keys[1]]]
    t.check()


def test_a_page_in_use_is_never_evicted():
    t = table(num_pages=5)  # 4 usable pages
    keys = page_keys(list(range(8)), PS, root_key())
    assert t.ensure(0, 8)
    t.register(0, 0, keys)
    t.attach(1, t.cache.lookup(keys))
    t.release(0)  # still held by row 1
    assert t.free_pages == 2
    assert not t.ensure(2, 3 * PS)  # only two pages can be had: the shared ones are in use
    assert t.ensure(2, 2 * PS)
    assert t.cache.lookup(keys) == list(t.table[1, :2])
    t.check()


def test_the_share_bounds_the_idle_pages():
    t = table(capacity=2)
    keys = page_keys(list(range(16)), PS, root_key())
    assert t.ensure(0, 16)
    t.register(0, 0, keys)
    t.release(0)
    assert t.idle_pages == 2 and len(t.cache) == 2
    # The tail went first (released first): the prefix's head, worth most, stays.
    assert t.cache.lookup(keys) == [1, 2]
    t.check()
    t.release_all()
    assert len(t.cache) == 0 and t.free_pages == t.usable_pages
    t.check()


def test_a_key_cached_twice_keeps_the_first_page():
    t = table()
    keys = page_keys(list(range(4)), PS, root_key())
    assert t.ensure(0, 4) and t.ensure(1, 4)
    assert t.register(0, 0, keys) == 1
    assert t.register(1, 0, keys) == 0  # row 1's page stays its own
    assert t.cache.lookup(keys) == [int(t.table[0, 0])]
    t.release(1)
    assert t.idle_pages == 0  # row 1's page was not cached: it is free
    t.check()


OPS = st.lists(st.tuples(st.sampled_from(["admit", "grow", "release"]),
                         st.integers(0, 3), st.integers(0, 2), st.integers(1, 24)),
               min_size=1, max_size=60)


@settings(max_examples=150, deadline=None)
@given(OPS, st.integers(0, 8))
def test_random_sharing_keeps_the_books(ops, capacity):
    """Rows admit prompts drawn from three prefixes (sharing what the cache has), grow, and
    release, in any order: every page is always free, idle or held as often as its count
    says, and when every row is gone all references are back."""
    t = table(num_pages=13, slots=4, max_len=32, capacity=capacity)
    prompts = [[p] * 8 + list(range(100 * p, 100 * p + 24)) for p in range(3)]
    state: dict[int, tuple[list[int], int]] = {}  # row -> (tokens, positions written)
    for op, row, which, n in ops:
        if op == "admit" and row not in state:
            tokens = prompts[which][:n]
            keys = page_keys(tokens, PS, root_key())
            limit = (len(tokens) - 1) // PS
            hits = t.cache.lookup(keys[:limit])
            hits = hits[:max(0, min(len(hits), t.free_pages))]
            t.attach(row, hits)
            written = len(hits) * PS
            if t.ensure(row, len(tokens)):
                written = len(tokens)
                t.register(row, len(hits), keys[len(hits):])
            state[row] = (tokens, written)
        elif op == "grow" and row in state:
            tokens, written = state[row]
            if (written == len(tokens) and written + n <= 32
                    and t.ensure(row, written + n)):
                state[row] = (tokens + [7] * n, written + n)
        elif op == "release" and row in state:
            t.release(row)
            del state[row]
        t.check()
        for r, (_, written) in state.items():
            assert t.owned[r] * PS >= written
    for r in list(state):
        t.release(r)
    t.check()
    assert t.free_pages == t.usable_pages
    assert np.all(t.refcount[1:] == 0)


def test_attach_past_the_table_is_refused():
    t = table(max_len=8)
    with pytest.raises(ValueError):
        t.attach(0, [1, 2, 3])
