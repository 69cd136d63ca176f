"""The scheduler's waiting queue: priority first, FIFO within a tenant, round-robin across
tenants.

Each tenant (`GenerationRequest.tenant`; None is one tenant like any other) has its own queue,
ordered by the requests' `priority` (vLLM's: lower value first, default 0) and, among equal
priorities, by arrival (FIFO). The tenants take turns: among the tenants that may go, the one
whose head has the lowest priority value goes first; among heads of equal priority, the tenant
whose turn it is (the rotation's order), which then goes to the back of the rotation. A tenant
with 64 queued requests therefore delays another tenant's single request of the same priority
by at most one admission per tenant ahead of it in the rotation, not by its 64. With one
tenant and one priority (a server without API keys, requests without `priority`) this is
exactly a FIFO queue.

A tenant's share of the slots (`GenerationRequest.tenant_slots`, read from the request at
the head of its queue) caps the rows its requests hold at once: at the cap its requests wait
and the other tenants' are admitted, whatever their priorities (priorities order requests
within the fairness, never past a share). A tenant holding no row may always start one
request, even one wider than its share (a beam search), so nothing waits forever.

Each tenant's queue is a binary heap of (priority, order, request): `append` and `take` cost
O(log n) in the tenant's queue plus O(T) over the T tenants waiting. `order` counts up for
`append` and down for `appendleft` (a preempted request): a preempted request goes first
among the requests of its priority, ahead of those that arrived before it.

Not thread-safe: the scheduler holds its lock around every call.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterator
from typing import Any

from metrale_jax.errors import InvalidParameterError

Tenant = str | None

PRIORITY_MIN = -(2**31)
PRIORITY_MAX = 2**31 - 1
"""The priorities a request may have (a signed 32-bit integer, as vLLM's is in practice)."""


def check_priority(value: Any, param: str = "priority") -> int:
    """`value` as a request priority: an integer (not a bool, not a float) in
    [PRIORITY_MIN, PRIORITY_MAX]; raises `InvalidParameterError` naming `param` otherwise."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidParameterError(f"{param} must be an integer, not {value!r}", param=param)
    if not PRIORITY_MIN <= value <= PRIORITY_MAX:
        raise InvalidParameterError(f"{param} must be between {PRIORITY_MIN} and "
                                    f"{PRIORITY_MAX}, not {value}", param=param)
    return int(value)


def priority_of(seq: Any) -> int:
    """A queued or running sequence's request priority (0 when the request has none)."""
    return getattr(seq.request, "priority", 0)


class WaitingQueue:
    """The requests (`scheduler.sequence.Sequence`s) waiting for a slot, per tenant."""

    def __init__(self) -> None:
        # tenant -> its heap of (priority, order, seq); the dict's order is the rotation
        # (first: whose turn it is among heads of equal priority)
        self._queues: dict[Tenant, list[tuple[int, int, Any]]] = {}
        self._size = 0
        self._later = itertools.count()  # order of `append`: 0, 1, 2, ...
        self._sooner = itertools.count(-1, -1)  # order of `appendleft`: -1, -2, ...

    def __len__(self) -> int:
        return self._size

    def __bool__(self) -> bool:
        return self._size > 0

    def __iter__(self) -> Iterator[Any]:
        """Every waiting request, tenant by tenant in rotation order, each tenant's in the
        order it would be admitted."""
        for heap in list(self._queues.values()):
            for _, _, seq in sorted(heap, key=lambda e: e[:2]):
                yield seq

    def append(self, seq: Any) -> None:
        """Queues `seq` behind its tenant's requests of the same or a better priority (a new
        tenant joins the rotation last)."""
        self._push(seq, next(self._later))

    def appendleft(self, seq: Any) -> None:
        """Puts `seq` (a preempted request) first among its tenant's requests of its
        priority, and its tenant first in the rotation: with one priority, it is the next
        request admitted."""
        tenant = seq.request.tenant
        heap = self._queues.pop(tenant, [])
        self._queues = {tenant: heap, **self._queues}
        self._push(seq, next(self._sooner))

    def _push(self, seq: Any, order: int) -> None:
        heap = self._queues.setdefault(seq.request.tenant, [])
        heapq.heappush(heap, (priority_of(seq), order, seq))
        self._size += 1

    def by_tenant(self) -> dict[Tenant, int]:
        """{tenant: requests waiting}."""
        return {t: len(q) for t, q in self._queues.items()}

    def peek(self, held: Callable[[Tenant], int],
             blocked: Callable[[Any], bool] | None = None) -> Any | None:
        """The request `take` would admit next given enough free rows (None: none may go).

        held(tenant): the rows the tenant's requests hold now. Tenants at their share, and
        those whose head is `blocked` (a request preempted by priority that waits for the
        one it made room for), are passed over; among the others, the head with the lowest
        priority value, and among equal ones the first tenant in the rotation.
        """
        best: tuple[int, Tenant] | None = None
        for tenant, heap in self._queues.items():
            prio, _, head = heap[0]
            if best is not None and prio >= best[0]:
                continue
            if blocked is not None and blocked(head):
                continue
            cap = head.request.tenant_slots
            if cap is not None:
                used = held(tenant)
                if used and used + head.request.params.num_beams > cap:
                    continue  # at its share: the other tenants go first
            best = (prio, tenant)
        return None if best is None else self._queues[best[1]][0][2]

    def take(self, free: int, held: Callable[[Tenant], int],
             blocked: Callable[[Any], bool] | None = None) -> Any | None:
        """Removes and returns the next request to admit into `free` free rows, or None.

        held, blocked: as `peek`, whose request is the next one;
        it needs `num_beams` rows at once; when fewer are free, nothing is admitted (it keeps
        its turn: smaller requests behind it do not overtake it forever).
        """
        head = self.peek(held, blocked)
        if head is None or head.request.params.num_beams > free:
            return None
        tenant = head.request.tenant
        heap = self._queues.pop(tenant)
        heapq.heappop(heap)
        self._size -= 1
        if heap:  # its turn is over: to the back of the rotation
            self._queues[tenant] = heap
        return head

    def remove_where(self, pred: Callable[[Any], bool]) -> list[Any]:
        """Removes every request for which `pred` is true; returns them (queue order)."""
        removed: list[Any] = []
        for tenant in list(self._queues):
            heap = self._queues[tenant]
            out = sorted((e for e in heap if pred(e[2])), key=lambda e: e[:2])
            if not out:
                continue
            removed += [seq for _, _, seq in out]
            gone = {id(o[2]) for o in out}
            keep = [e for e in heap if id(e[2]) not in gone]
            if keep:
                heapq.heapify(keep)
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
