"""A step that raised: only its requests fail, the decode state is rebuilt, the loop goes on.

`StepRunner` raises `StepFailureError` when launching a step or reading its output raises (a
device error surfaces when its output is read). The step's requests (its decode rows and
the prompts whose pieces rode along) end with `Failed(StepFailedError)` (HTTP 500, a
streamed answer's error event). The decode state was donated into the failed call (and
into any step launched after it), so it is rebuilt: every other request holding a row is
put back at the head of the queue and recomputed (as preemption does: its client sees only
latency), every page goes back to the pool and the prefix cache is emptied. When the state
cannot be rebuilt, the engine is *broken*: every request fails with `EngineBrokenError` and
new ones are refused (the server's /health turns 503). `UNHEALTHY_AFTER` failed steps in a
row also turn /health 503, until a step succeeds.

A row whose output alone raises while the step's output is handed out (detokenizing, stop
strings, a grammar) fails only its own request (`fail_row`); the state is untouched.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable, Iterable

from metrale_jax.scheduler.events import Failed
from metrale_jax.scheduler.preemption import Preemption
from metrale_jax.scheduler.rows import Rows
from metrale_jax.scheduler.sequence import Sequence
from metrale_jax.scheduler.watchdog import EngineBrokenError, StepFailedError

log = logging.getLogger(__name__)

UNHEALTHY_AFTER = 3
"""Failed steps in a row that turn the server's /health to 503 until a step succeeds."""


class StepFailureError(Exception):
    """Launching a step or reading its output raised `cause`; `seqs` are its requests."""

    def __init__(self, cause: BaseException, seqs: Iterable[Sequence], where: str):
        super().__init__(f"the step's {where} failed: {type(cause).__name__}: {cause}")
        self.cause = cause
        self.where = where
        self.seqs = [_primary(s) for s in seqs if s is not None]


def _primary(seq: Sequence) -> Sequence:
    """The sequence whose handle answers the request (a beam row's search's primary)."""
    return seq.beam.primary if seq.beam is not None else seq


class StepFailures:
    """Counts failed steps and recovers from them (loop thread only, but `problem`).

    Args:
        rows, preemption: the scheduler's parts.
        stats: the scheduler's counters ("step_failures", "step_failed_requests").

    Attributes:
        in_a_row: failed steps since the last step that succeeded.
        broken: why the decode state could not be rebuilt (None: it could).
    """

    def __init__(self, rows: Rows, preemption: Preemption, stats: collections.Counter):
        self.rows = rows
        self.preemption = preemption
        self.stats = stats
        self.in_a_row = 0
        self.last: str | None = None
        self.broken: str | None = None

    def succeeded(self) -> None:
        """A step's output was read: the failures in a row are over."""
        self.in_a_row = 0

    @property
    def problem(self) -> str | None:
        """Why the loop is unhealthy because of failed steps (None: it is not)."""
        if self.broken is not None:
            return self.broken
        if self.in_a_row >= UNHEALTHY_AFTER:
            return f"{self.in_a_row} steps in a row failed (last: {self.last})"
        return None

    def recover(self, failure: StepFailureError, reset_state: Callable[[], None],
                requeue: Callable[[list[Sequence]], None]) -> None:
        """Fails `failure`'s requests, puts the other rows' requests back in the queue
        (`requeue`, in admission order) and rebuilds the decode state (`reset_state`; the
        steps in flight must be forgotten already). When that raises, `broken` is set and
        every row fails (the caller fails the queue)."""
        self.stats["step_failures"] += 1
        self.in_a_row += 1
        self.last = str(failure)
        log.error("%s; failing its %d request(s), rebuilding the decode state", failure,
                  len(failure.seqs), exc_info=failure.cause)
        error = StepFailedError(f"the server failed computing this request ({failure}); "
                                "other requests were not affected: retry")
        failed = {id(s) for s in failure.seqs}
        order = sorted(self.rows.admitted_at.items(), key=lambda kv: kv[1][1])
        back: list[Sequence] = []
        ended: list[Sequence] = []
        for slot, _ in order:
            seq = self.rows[slot]
            if seq is None:
                continue
            seq = self.preemption.free_rows(slot, seq)
            (ended if id(seq) in failed or seq.finished else back).append(seq)
        for slot in range(len(self.rows)):  # rows without an admission time (none expected)
            seq = self.rows[slot]
            if seq is not None:
                ended.append(self.preemption.free_rows(slot, seq))
        try:  # (before any answer: a client that sees its failure sees the loop's health)
            reset_state()
        except Exception as e:
            log.critical("could not rebuild the decode state after a failed step",
                         exc_info=True)
            self.broken = (f"the engine's decode state could not be rebuilt after a failed "
                           f"step: {type(e).__name__}: {e}")
        for seq in ended:
            self._fail(seq, error)
        if self.broken is not None:
            for seq in back:
                self._fail(seq, EngineBrokenError(self.broken))
            return
        requeue(back)

    def fail_row(self, slot: int, seq: Sequence, cause: BaseException) -> None:
        """Row `slot`'s output raised `cause` while handed out: its request alone fails and
        its rows are freed."""
        log.error("handing out request %s's tokens failed; failing it",
                  seq.request.request_id, exc_info=cause)
        seq = self.preemption.free_rows(slot, seq)
        self._fail(seq, StepFailedError(
            f"the server failed handing out this request's tokens ({type(cause).__name__}: "
            f"{cause}); other requests were not affected: retry"))

    def _fail(self, seq: Sequence, error: BaseException) -> None:
        """Ends `seq` with `Failed(error)` (a handle ignores it after its end)."""
        if not seq.finished:
            seq.finished = True
            self.stats["step_failed_requests"] += 1
        seq.handle.post(Failed(error))
