"""The batching loop's watchdog, and the errors of a stalled or failing loop.

The loop calls `Watchdog.beat()` whenever it makes progress: a step's output was read, or it
found nothing to do. A daemon thread (`metrale-watchdog`) checks that monotonic timestamp a
few times per `timeout`; nothing here touches JAX. When work is pending (`pending()`: requests
waiting, rows held or steps in flight) and no beat came for `timeout` seconds, the loop is
*stalled* (a hung collective, a deadlock, a stuck compile): the stacks of every thread go to
the log once, `on_stall(reason)` runs (the scheduler fails its waiting requests with
`StalledError` and refuses new ones), and with `exit_on_stall` the process ends with
`EXIT_STALLED` so a supervisor restarts it. The next beat ends the stall (`on_resume`).

`StalledError`, `StepFailedError` and `EngineBrokenError` are the server-side faults the
loop answers requests with (503, 500 and 503, in the OpenAI error shape).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable

from metrale_jax.errors import MetraleError

log = logging.getLogger(__name__)

EXIT_STALLED = 4
"""The exit status of a process ended by the watchdog (`exit_on_stall`); 3 is a lost peer's."""
DEFAULT_STALL_TIMEOUT_S = 120.0
"""The stall timeout when none is given: at least this, or the foreground warmup's time."""


class StalledError(MetraleError):
    """The batching loop made no progress for the stall timeout (503, retry later)."""

    status = 503
    error_type = "server_error"
    retry_after = 5.0  # seconds (the server's Retry-After)

    def __init__(self, message: str):
        super().__init__(message, code="stalled")


class StepFailedError(MetraleError):
    """The step computing this request failed on the server (500); other requests go on."""

    status = 500
    error_type = "server_error"

    def __init__(self, message: str):
        super().__init__(message, code="step_failed")


class EngineBrokenError(MetraleError):
    """The engine's decode state could not be rebuilt after a failed step (503)."""

    status = 503
    error_type = "server_error"
    retry_after = 30.0  # seconds (the server's Retry-After: a restart is needed)

    def __init__(self, message: str):
        super().__init__(message, code="engine_broken")


def stall_timeout_for(configured: float | None, warmup_s: float) -> float:
    """The stall timeout in seconds: `configured` when given (> 0), else the larger of
    `DEFAULT_STALL_TIMEOUT_S` and `warmup_s` (the foreground warmup's seconds, an upper bound
    of one compile's: a compile on first use counts as a stall only past it)."""
    if configured is not None:
        if configured <= 0:
            raise ValueError(f"stall_timeout must be > 0 seconds, not {configured!r}")
        return float(configured)
    return max(DEFAULT_STALL_TIMEOUT_S, float(warmup_s))


def thread_stacks() -> str:
    """The Python stack of every thread, formatted (the watchdog's log of a stall)."""
    names = {t.ident: t.name for t in threading.enumerate()}
    parts = []
    for ident, frame in sys._current_frames().items():
        stack = "".join(traceback.format_stack(frame))
        parts.append(f'Thread "{names.get(ident, "?")}" ({ident}):\n{stack}')
    return "\n".join(parts)


def exit_now(code: int) -> None:
    """`os._exit(code)` after flushing the logs and stdio (the loop thread may be stuck for
    good: a normal exit would wait for it)."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(code)


class Watchdog:
    """Watches a loop's progress timestamp from its own daemon thread.

    Args:
        timeout: seconds without a beat, while `pending()`, that make a stall (> 0).
        pending: whether the loop has work (called from the watchdog thread; must not block).
        on_stall: `on_stall(reason)` once per stall, after the stacks are logged.
        on_resume: called when a beat ends a stall.
        exit_on_stall: end the process with `EXIT_STALLED` after `on_stall`.
        exit: the function that ends the process (`exit_now`; tests pass another).
        grace: seconds between `on_stall` and the exit, for the 503 answers to go out.

    Attributes:
        stalled: the current stall's reason (None: none). stalls: stalls seen since start.
        ticks: checks made so far (a test waits on them, never on time).
    """

    def __init__(self, timeout: float, pending: Callable[[], bool],
                 on_stall: Callable[[str], None] | None = None,
                 on_resume: Callable[[], None] | None = None, exit_on_stall: bool = False,
                 exit: Callable[[int], None] = exit_now, grace: float = 1.0):
        self.timeout = stall_timeout_for(timeout, 0.0)
        self.pending = pending
        self.on_stall = on_stall
        self.on_resume = on_resume
        self.exit_on_stall = exit_on_stall
        self.exit = exit
        self.grace = grace
        self.stalled: str | None = None
        self.stalls = 0
        self.ticks = 0
        self._last = time.monotonic()
        self._tick = threading.Condition()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> Watchdog:
        """Starts the watchdog thread (the timestamp starts now); not after `stop`."""
        self._last = time.monotonic()
        if not self._stop.is_set():
            thread = threading.Thread(target=self._run, name="metrale-watchdog", daemon=True)
            thread.start()
            self._thread = thread
        return self

    def stop(self) -> None:
        """Ends the watchdog thread."""
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(5)

    def set_timeout(self, seconds: float) -> None:
        """Changes the stall timeout (> 0 s), from the next check on."""
        self.timeout = stall_timeout_for(seconds, 0.0)

    def beat(self) -> None:
        """The loop made progress (any thread; cheap). Ends a stall."""
        self._last = time.monotonic()
        if self.stalled is not None:
            log.warning("the batching loop makes progress again")
            self.stalled = None
            if self.on_resume is not None:
                self.on_resume()

    def wait_ticks(self, n: int, timeout: float = 30.0) -> bool:
        """Blocks until `n` more checks have run (tests); False on a timeout."""
        with self._tick:
            target = self.ticks + n
            return self._tick.wait_for(lambda: self.ticks >= target, timeout)

    def _run(self) -> None:
        while not self._stop.wait(min(1.0, self.timeout / 4)):
            try:
                self.check()
            except Exception:  # the watchdog must outlive its own bugs
                log.exception("the watchdog's check failed")
            with self._tick:
                self.ticks += 1
                self._tick.notify_all()

    def check(self) -> None:
        """One check: starts a stall when work is pending and no beat came for `timeout`."""
        if self.stalled is not None:
            return
        idle_s = time.monotonic() - self._last
        if idle_s < self.timeout or not self.pending():
            return
        reason = (f"the batching loop made no progress for {idle_s:.1f} s with work pending "
                  f"(stall timeout {self.timeout:g} s)")
        self.stalled = reason
        self.stalls += 1
        log.error("%s; the stacks of every thread:\n%s", reason, thread_stacks())
        if self.on_stall is not None:
            self.on_stall(reason)
        if self.exit_on_stall:
            log.critical("exiting with status %d (exit on stall)", EXIT_STALLED)
            time.sleep(self.grace)  # the answers' time to reach their clients
            self.exit(EXIT_STALLED)
