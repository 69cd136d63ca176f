"""A bounded in-memory store of past responses (least recently used out first): what
`previous_response_id` continues from and GET /v1/responses/{id} returns. Lost on restart."""

from __future__ import annotations

import collections
import threading
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Stored:
    """One stored response: its body and the conversation items it ends (earlier items,
    its input, its output), for a later `previous_response_id`; `owner`: the caller's tenant
    or key name (None without keys): only the same owner sees it."""

    response: dict[str, Any]
    items: list[dict[str, Any]]
    owner: str | None = None


class ResponseStore:
    """At most `capacity` responses by id (a put beyond it drops the least recently used)."""

    def __init__(self, capacity: int = 256):
        self.capacity = capacity
        self._data: collections.OrderedDict[str, Stored] = collections.OrderedDict()
        self._lock = threading.Lock()

    def put(self, stored: Stored) -> None:
        """Keeps `stored` under its response's id."""
        with self._lock:
            self._data[stored.response["id"]] = stored
            self._data.move_to_end(stored.response["id"])
            while len(self._data) > self.capacity:
                self._data.popitem(last=False)

    def get(self, response_id: str, owner: str | None = None) -> Stored | None:
        """The stored response `response_id` of `owner`, or None."""
        with self._lock:
            stored = self._data.get(response_id)
            if stored is not None and stored.owner != owner:
                return None
            if stored is not None:
                self._data.move_to_end(response_id)
            return stored

    def delete(self, response_id: str) -> bool:
        """Drops `response_id`; True when it was there."""
        with self._lock:
            return self._data.pop(response_id, None) is not None
