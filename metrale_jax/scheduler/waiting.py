"""The scheduler's waiting queue: FIFO within a tenant, round-robin across tenants.

Each tenant (`GenerationRequest.tenant`; None is one tenant like any other) has its own FIFO
queue, and the tenants take turns: the next request admitted is the head of the tenant
whose turn it is, which then goes to the back of the rotation. A tenant with 64 queued
requests therefore delays another tenant's single request by at most one admission per
tenant ahead of it in the rotation, not by its 64. With one tenant (every request without
one: a server without API keys) this is exactly a FIFO queue.

A tenant's share of the slots (`GenerationRequest.tenant_slots`, read from the request at
the head of its queue) caps the rows its requests hold at once: at the cap its requests wait
and the other tenants' are admitted. A tenant holding no row may always start one request,
even one wider than its share (a beam search), so nothing waits forever.

Not thread-safe: the scheduler holds its lock around every call.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterator
from typing import Any

Tenant = str | None


class WaitingQueue:
    """The requests (`scheduler.sequence.Sequence`s) waiting for a slot, per tenant."""

    def __init__(self) -> None:
        # tenant -> its FIFO; the dict's order is the rotation (first: whose turn it is)
        self._queues: dict[Tenant, collections.deque[Any]] = {}
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def __bool__(self) -> bool:
        return self._size > 0

    def __iter__(self) -> Iterator[Any]:
        """Every waiting request, tenant by tenant in rotation order, FIFO within each."""
        for q in self._queues.values():
            yield from q

    def append(self, seq: Any) -> None:
        """Queues `seq` behind its tenant's requests (a new tenant joins the rotation last)."""
        tenant = seq.request.tenant
        q = self._queues.get(tenant)
        if q is None:
            q = self._queues[tenant] = collections.deque()
        q.append(seq)
        self._size += 1

    def appendleft(self, seq: Any) -> None:
        """Puts `seq` (a preempted request) first: at the head of its tenant's queue, and its
        tenant first in the rotation, so it is the next request admitted."""
        tenant = seq.request.tenant
        q = self._queues.pop(tenant, None) or collections.deque()
        q.appendleft(seq)
        self._queues = {tenant: q, **self._queues}
        self._size += 1

    def by_tenant(self) -> dict[Tenant, int]:
        """{tenant: requests waiting}."""
        return {t: len(q) for t, q in self._queues.items()}

    def take(self, free: int, held: Callable[[Tenant], int]) -> Any | None:
        """Removes and returns the next request to admit into `free` free rows, or None.

        held(tenant): the rows the tenant's requests hold now. Tenants at their share are
        passed over. The head of the first tenant that may go next needs `num_beams` rows
        at once; when fewer are free, nothing is admitted (it keeps its turn: smaller
        requests behind it do not overtake it forever).
        """
        for tenant, q in self._queues.items():
            head = q[0]
            cap = head.request.tenant_slots
            rows = head.request.params.num_beams
            used = held(tenant) if cap is not None else 0
            if cap is not None and used and used + rows > cap:
                continue  # at its share: the other tenants go first
            if rows > free:
                return None
            q.popleft()
            self._size -= 1
            del self._queues[tenant]
            if q:  # its turn is over: to the back of the rotation
                self._queues[tenant] = q
            return head
        return None

    def remove_where(self, pred: Callable[[Any], bool]) -> list[Any]:
        """Removes every request for which `pred` is true; returns them (queue order)."""
        removed = []
        for tenant in list(self._queues):
            q = self._queues[tenant]
            keep = collections.deque()
            for seq in q:
                (removed if pred(seq) else keep).append(seq)
            if keep:
                self._queues[tenant] = keep
            else:
                del self._queues[tenant]
        self._size -= len(removed)
        return removed

    def clear(self) -> list[Any]:
        """Empties the queue; returns what it held (rotation order)."""
        out = list(self)
        self._queues = {}
        self._size = 0
        return out
