"""The prefix cache's index: full KV pages addressed by their content, and the LRU of idle ones.

A full page's key hashes its parent page's key and its `page_size` token ids (`page_keys`); the
first page's parent is the sequence's *root* key (`root_key`), which hashes everything besides
the tokens that changes the keys and values or must keep sequences apart: the isolation key
(tenant and `cache_salt`) and, later, the adapter. Two sequences share a page only when every
token before its end and every root input agree, so the key of page j names the whole prefix
`0 .. (j + 1) * page_size - 1`. Keys are SHA-256 digests (hex), the same in every process.

`PrefixCache` maps keys to pages of a `PageTable` (engine/pages.py) and back, and keeps the
cached pages that no sequence holds in least-recently-released order: the table takes its free
pages first and evicts from the front of that order when it has none, and `capacity` bounds
how many idle pages the cache keeps at all. Pages in use are never evicted: they are not in
the idle order. The class holds no JAX state; it is deterministic, so processes that replay
the same calls hold the same index (multi-host).
"""

from __future__ import annotations

import collections
import hashlib
from collections.abc import Sequence

import numpy as np


def root_key(*parts: str | None) -> str:
    """The root key of a sequence's page chain: a hash of its isolation parts (tenant,
    cache_salt, adapter ...; None and "" differ from any set value). No parts: the public
    namespace."""
    h = hashlib.sha256(b"metrale-prefix-v1")
    for part in parts:
        data = b"\x00" if part is None else b"\x01" + part.encode()
        h.update(len(data).to_bytes(4, "little") + data)
    return h.hexdigest()


def page_keys(tokens: Sequence[int], page_size: int, parent: str, first: int = 0,
              count: int | None = None) -> list[str]:
    """Keys of the full pages `first, first + 1, ...` of `tokens` (the sequence from position
    0), at most `count` of them; `parent` is the key of page `first - 1` (the root key for
    page 0). A trailing partial page has no key."""
    full = len(tokens) // page_size
    last = full if count is None else min(full, first + count)
    keys = []
    for j in range(first, last):
        page = np.asarray(tokens[j * page_size:(j + 1) * page_size], np.int64)
        parent = hashlib.sha256(parent.encode() + page.tobytes()).hexdigest()
        keys.append(parent)
    return keys


class PrefixCache:
    """Content keys of cached pages, and the idle ones in LRU order.

    Args:
        capacity: the most idle pages (cached, held by no sequence) kept; releasing a page
            beyond it evicts the oldest idle page.
    Attributes:
        pages: key -> page; keys: page -> key; idle: the idle pages, oldest first.
    """

    def __init__(self, capacity: int):
        self.capacity = max(0, int(capacity))
        self.pages: dict[str, int] = {}
        self.keys: dict[int, str] = {}
        self.idle: collections.OrderedDict[int, None] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self.pages)

    def lookup(self, keys: Sequence[str]) -> list[int]:
        """The pages of the longest run of `keys`, from the first, that is cached."""
        out = []
        for key in keys:
            page = self.pages.get(key)
            if page is None:
                break
            out.append(page)
        return out

    def add(self, page: int, key: str) -> bool:
        """Caches `page` (held by a sequence) under `key`; False when the key is cached
        already (another page holds that content) or the page has a key."""
        if key in self.pages or page in self.keys:
            return False
        self.pages[key] = page
        self.keys[page] = key
        return True

    def hold(self, page: int) -> None:
        """A sequence takes idle `page`: it leaves the LRU order."""
        self.idle.pop(page, None)

    def park(self, page: int) -> list[int]:
        """The last sequence let go of cached `page`: it becomes the newest idle page. Returns
        the pages evicted to stay within capacity (their keys dropped; they are free)."""
        self.idle[page] = None
        evicted = []
        while len(self.idle) > self.capacity:
            evicted.append(self.evict())
        return evicted

    def evict(self) -> int:
        """Drops the oldest idle page's key and returns the page (now free)."""
        page, _ = self.idle.popitem(last=False)
        del self.pages[self.keys.pop(page)]
        return page

    def clear(self) -> None:
        """Forgets every key (the pool's contents are gone)."""
        self.pages.clear()
        self.keys.clear()
        self.idle.clear()
