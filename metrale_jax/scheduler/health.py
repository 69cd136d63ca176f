"""The batching loop's health: its watchdog (watchdog.py) and its failed steps
(step_failures.py), as the `Scheduler` uses them.

The loop reports its progress (`progressed`: a step's output was read; `idle`: it waits for
work), a failed step (`step_failed`) and its warmup's end (`start`); callers are refused
while the loop is stalled or its engine is broken (`refuse_if_unhealthy`); `problem` says
why the loop is unhealthy (the server's /health answers 503 with it).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

from metrale_jax.scheduler.events import Failed
from metrale_jax.scheduler.preemption import Preemption
from metrale_jax.scheduler.rows import Rows
from metrale_jax.scheduler.sequence import Sequence
from metrale_jax.scheduler.step_failures import StepFailureError, StepFailures
from metrale_jax.scheduler.watchdog import (
    EXIT_STALLED,
    EngineBrokenError,
    StalledError,
    Watchdog,
    stall_timeout_for,
)

log = logging.getLogger(__name__)


class LoopHealth:
    """The watchdog and failed steps of one scheduler's loop.

    Args:
        rows, preemption, steps: the scheduler's parts (`steps`: its `StepRunner`).
        stats: the scheduler's counters ("stalls", "step_failures", "step_failed_requests").
        lock: the scheduler's lock, which guards `waiting` (its `WaitingQueue`).
        stall_timeout: seconds (None: the larger of 120 s and the warmup's, set by `start`).
        exit_on_stall: a stall ends the process (`watchdog.EXIT_STALLED`).

    Attributes:
        watchdog: the `Watchdog`. failures: the `StepFailures`.
    """

    def __init__(self, rows: Rows, preemption: Preemption, steps: Any,
                 stats: collections.Counter, lock: threading.Lock, waiting: Any,
                 stall_timeout: float | None = None, exit_on_stall: bool = False):
        self.rows = rows
        self.steps = steps
        self.stats = stats
        self._lock = lock
        self._waiting = waiting
        self._stall_timeout = stall_timeout
        self.failures = StepFailures(rows, preemption, stats)
        self.watchdog = Watchdog(stall_timeout_for(stall_timeout, 0.0), self._has_work,
                                 self._on_stall, exit_on_stall=exit_on_stall)
        self._idle = False  # the loop waits for work (set under the lock)
        steps.on_read = self.progressed
        steps.on_row_error = self.failures.fail_row

    @property
    def problem(self) -> str | None:
        """Why the loop is unhealthy: stalled, its decode state lost, or several steps in a
        row failed; None when healthy."""
        return self.failures.broken or self.watchdog.stalled or self.failures.problem

    def refuse_if_unhealthy(self) -> None:
        """Raises `EngineBrokenError` or `StalledError` (503) when no request can be served."""
        if self.failures.broken is not None:
            raise EngineBrokenError(self.failures.broken)
        stalled = self.watchdog.stalled
        if stalled is not None:
            raise StalledError(f"the server is stalled ({stalled}); retry later")

    def start(self, warmup_s: float) -> None:
        """The loop serves from now on (its warmup took `warmup_s`): the watchdog starts."""
        if self._stall_timeout is None:  # a compile counts as a stall only past warmup's
            self.watchdog.set_timeout(stall_timeout_for(None, warmup_s))
        self.watchdog.start()

    def submitted(self) -> None:
        """A request was queued (under the lock): an idle loop's stall clock starts now."""
        if self._idle:
            self.watchdog.beat()

    @contextlib.contextmanager
    def idle(self) -> Iterator[None]:
        """Around the loop's wait for work (under the lock): a request queued meanwhile
        starts the stall clock (`submitted`), and the wait's end is progress."""
        self._idle = True
        try:
            yield
        finally:
            self._idle = False
            self.watchdog.beat()

    def progressed(self) -> None:
        """A step's output was read (the loop thread): progress, and a step that worked."""
        self.watchdog.beat()
        self.failures.succeeded()

    def step_failed(self, failure: StepFailureError,
                    fail_all: Callable[[BaseException], None]) -> None:
        """A step raised (the loop thread): its requests fail, the state is rebuilt and the
        other running requests go back to the head of the queue. When the state cannot be
        rebuilt, `fail_all(error)` fails everything (`failures.broken` says why)."""
        self.steps.clear()
        self.failures.recover(failure, self.steps.reset_state, self._requeue)
        if self.failures.broken is not None:
            fail_all(EngineBrokenError(self.failures.broken))
            if self.watchdog.exit_on_stall:  # nothing can be served until a restart
                log.critical("exiting with status %d (exit on stall)", EXIT_STALLED)
                self.watchdog.exit(EXIT_STALLED)

    def _requeue(self, seqs: list[Sequence]) -> None:
        """Puts `seqs` back at the head of the queue, in this order (recomputed later)."""
        with self._lock:
            for seq in reversed(seqs):
                self._waiting.appendleft(seq)

    def _has_work(self) -> bool:
        """Whether requests wait or run (the watchdog's thread; read without the lock)."""
        return bool(len(self._waiting) or self.rows.busy() or self.steps.pending)

    def _on_stall(self, reason: str) -> None:
        """The watchdog saw a stall (its thread): the waiting requests get `StalledError`;
        with exit on stall, so do the running ones (the process ends next)."""
        self.stats["stalls"] += 1
        error = StalledError(f"the server is stalled ({reason}); retry later")
        if not self._lock.acquire(timeout=1.0):  # the loop is stuck holding it
            log.error("the stalled loop holds the queue's lock: waiting requests not failed")
            return
        try:
            waiting = self._waiting.clear()
        finally:
            self._lock.release()
        for seq in waiting:
            seq.handle.post(Failed(error))
        if self.watchdog.exit_on_stall:
            for seq in list(self.rows.seqs):
                if seq is not None:
                    seq.handle.post(Failed(error))
