"""`StepGate`: holds an engine's steps so a test can look at the batching loop between two.

While the gate is closed every `engine.step` waits inside the call: requests submitted then
stay queued, and the slots keep what they hold. `next()` lets exactly one step run and
returns once the loop is held in the following one, so the loop has done exactly one
admission round in between; `snapshot()` then shows it. No timing decides anything.
"""

from __future__ import annotations

import contextlib
import threading


class StepGate:
    """Holds every `engine.step` until `next()` lets one through, or `open()` all."""

    def __init__(self, engine):
        self.engine = engine
        self.entered = threading.Event()  # set when a step is held
        self._go = threading.Semaphore(0)
        self.is_open = False
        real = engine.step

        def step(*args, **kwargs):
            if not self.is_open:
                self.entered.set()
                self._go.acquire(timeout=120)
            return real(*args, **kwargs)
        engine.step = step

    def next(self, timeout: float = 60) -> None:
        """Lets the held step run; returns once the loop is held in its next step."""
        self.entered.clear()
        self._go.release()
        assert self.entered.wait(timeout), "the loop did not reach its next step"

    def open(self) -> None:
        """Lets every step run from now on (the engine's own method again)."""
        if self.is_open:
            return
        self.is_open = True
        self._go.release()
        del self.engine.step


@contextlib.contextmanager
def gated(engine):
    """A `StepGate` on `engine`, opened when the block ends."""
    gate = StepGate(engine)
    try:
        yield gate
    finally:
        gate.open()
