"""The loop's watchdog and failed steps (scheduler/watchdog.py, scheduler/step_failures.py).

The loop is held inside its step (tests/step_gate.py) to stall it; the watchdog's stall
timeout is made short for the test and set back before the step is let go. Waits are on the
watchdog's checks (`wait_ticks`), never on time. A failing step is injected by wrapping the
engine's step (its launch) or with `StepRunner.fault` (one row's output).
"""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator

import numpy as np
import pytest

from metrale_jax import SamplingParams
from metrale_jax.completion import collect
from metrale_jax.scheduler import Failed, GenerationRequest
from metrale_jax.scheduler.step_failures import UNHEALTHY_AFTER
from metrale_jax.scheduler.watchdog import (
    EXIT_STALLED,
    StalledError,
    StepFailedError,
    stall_timeout_for,
)
from tests.step_gate import gated

PARAMS = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


def _submit(llm, rid: str, seed: int = 0, params: SamplingParams = PARAMS):
    prompt = np.random.default_rng(seed).integers(3, 1000, 12).tolist()
    return llm.scheduler.submit(GenerationRequest.make(prompt, params, request_id=rid))


def _end(handle) -> object:
    return list(handle)[-1]


def _until(scheduler, cond: Callable[[], bool], ticks: int = 2000) -> bool:
    """Waits, one watchdog check at a time, until `cond()`."""
    for _ in range(ticks):
        if cond():
            return True
        assert scheduler.health.watchdog.wait_ticks(1)
    return cond()


def _pages_all_back(engine) -> bool:
    engine.pages.check()
    return engine.pages.free_pages == engine.pages.usable_pages  # (idle cached ones count)


@pytest.fixture
def short_stall(tiny_llm) -> Iterator[object]:
    """The tiny LLM's scheduler with a 0.3 s stall timeout (set back afterwards)."""
    scheduler = tiny_llm.scheduler
    before = scheduler.health.watchdog.timeout
    scheduler.health.watchdog.set_timeout(0.3)
    try:
        yield scheduler
    finally:
        scheduler.health.watchdog.set_timeout(before)


def test_a_held_step_stalls_the_loop_until_it_goes_on(tiny_llm, short_stall, caplog):
    """A step held past the stall timeout: the health problem names the stall, the waiting
    request fails with StalledError, a new one is refused, the stacks are logged once; once
    the step goes on the held request completes and the loop is healthy again."""
    scheduler = short_stall
    stalls = scheduler.stats["stalls"]
    caplog.set_level(logging.ERROR, "metrale_jax.scheduler.watchdog")
    with gated(scheduler.engine) as gate:
        running = _submit(tiny_llm, "wd-running")
        assert gate.entered.wait(60)
        waiting = _submit(tiny_llm, "wd-waiting", seed=1)
        assert _until(scheduler, lambda: scheduler.health.problem is not None)
        assert "made no progress" in scheduler.health.problem
        end = _end(waiting)
        assert isinstance(end, Failed) and isinstance(end.error, StalledError)
        assert end.error.status == 503
        with pytest.raises(StalledError):
            _submit(tiny_llm, "wd-refused", seed=2)
        assert scheduler.health.watchdog.wait_ticks(3)  # more checks: still one dump
        dumps = [r for r in caplog.records if "the stacks of every thread" in r.getMessage()]
        assert len(dumps) == 1
        assert '"metrale-scheduler"' in dumps[0].getMessage()
        assert "step_gate.py" in dumps[0].getMessage()  # where the loop is held
        assert scheduler.stats["stalls"] == stalls + 1
        scheduler.health.watchdog.set_timeout(120)  # (a slow step after the release is no stall)
    assert collect(running).finish_reason == "length"
    assert _until(scheduler, lambda: scheduler.health.problem is None)
    assert collect(_submit(tiny_llm, "wd-after", seed=3)).finish_reason == "length"


def test_exit_on_stall_fails_every_request_then_exits(tiny_llm, short_stall):
    """With exit on stall, the running request gets StalledError too, then the exit function
    is called with EXIT_STALLED (recorded here: the real one is `os._exit`)."""
    scheduler = short_stall
    watchdog = scheduler.health.watchdog
    codes: list[int] = []
    watchdog.exit_on_stall, watchdog.exit, watchdog.grace = True, codes.append, 0.0
    try:
        with gated(scheduler.engine) as gate:
            running = _submit(tiny_llm, "wd-exit")
            assert gate.entered.wait(60)
            assert _until(scheduler, lambda: bool(codes))
            watchdog.exit_on_stall = False
            watchdog.set_timeout(120)
        assert codes == [EXIT_STALLED]
        end = _end(running)
        assert isinstance(end, Failed) and isinstance(end.error, StalledError)
    finally:
        watchdog.exit_on_stall = False
        from metrale_jax.scheduler.watchdog import exit_now
        watchdog.exit = exit_now
    assert _until(scheduler, lambda: scheduler.health.problem is None and not any(
        scheduler.snapshot()["slots"]))


def test_the_watchdog_ends_the_process_with_its_status():
    """The real exit: a process whose watchdog sees pending work and no beat exits with
    EXIT_STALLED after logging the stall."""
    script = textwrap.dedent("""
        import logging, threading
        from metrale_jax.scheduler.watchdog import Watchdog
        logging.basicConfig(level=logging.INFO)
        Watchdog(0.2, pending=lambda: True, exit_on_stall=True).start()
        threading.Event().wait(120)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == EXIT_STALLED, done.stderr
    assert "made no progress" in done.stderr
    assert f"exiting with status {EXIT_STALLED}" in done.stderr


def test_stall_timeout_default_covers_the_warmup():
    assert stall_timeout_for(None, 10.0) == 120.0
    assert stall_timeout_for(None, 500.0) == 500.0
    assert stall_timeout_for(5, 500.0) == 5.0
    with pytest.raises(ValueError):
        stall_timeout_for(0, 0.0)


def test_a_step_that_raises_fails_only_its_requests(tiny_llm):
    """The held step carries only the first request; it raises: that request fails with
    StepFailedError (500), the request queued meanwhile completes, every page comes back;
    UNHEALTHY_AFTER failures in a row make the loop unhealthy until a step succeeds."""
    scheduler = tiny_llm.scheduler
    engine = scheduler.engine
    failures, failed = scheduler.stats["step_failures"], scheduler.stats["step_failed_requests"]
    raising = [0]
    real = type(engine).step

    def step(*args, **kwargs):
        if raising[0]:
            raising[0] -= 1
            raise RuntimeError("injected step fault")
        return real(engine, *args, **kwargs)

    engine.step = step
    with gated(engine) as gate:  # (its wrapper calls `step`; it ends by removing both)
        bad = _submit(tiny_llm, "sf-bad")
        assert gate.entered.wait(60)
        good = _submit(tiny_llm, "sf-good", seed=1)  # waits: not in the held step
        raising[0] = 1  # the held step raises
    end = _end(bad)
    assert isinstance(end, Failed) and isinstance(end.error, StepFailedError)
    assert end.error.status == 500 and "injected step fault" in str(end.error)
    assert collect(good).finish_reason == "length"
    assert scheduler.stats["step_failures"] == failures + 1
    assert scheduler.stats["step_failed_requests"] == failed + 1
    assert scheduler.health.problem is None
    assert _pages_all_back(engine)

    # failures in a row: unhealthy until a step succeeds
    engine.step = step
    raising[0] = UNHEALTHY_AFTER
    try:
        ends = [_end(_submit(tiny_llm, f"sf-row-{i}", seed=i)) for i in range(UNHEALTHY_AFTER)]
        assert all(isinstance(e, Failed) for e in ends)
        assert "steps in a row failed" in scheduler.health.problem
        assert "injected step fault" in scheduler.health.problem
        assert collect(_submit(tiny_llm, "sf-ok", seed=9)).finish_reason == "length"
        assert scheduler.health.problem is None
    finally:
        raising[0] = 0
        del engine.step
    assert _pages_all_back(engine)


def test_a_row_whose_output_raises_fails_alone(tiny_llm):
    """Handing one row's tokens out raises: that request fails, the one decoding beside it in
    the same steps completes with the tokens it gets alone."""
    scheduler = tiny_llm.scheduler
    alone = collect(_submit(tiny_llm, "row-alone", seed=5)).token_ids

    def fault(seq):
        if seq.request.request_id == "row-bad":
            raise ValueError("injected output fault")

    scheduler.steps.fault = fault
    try:
        with gated(scheduler.engine):  # admitted in one round: the same steps
            bad = _submit(tiny_llm, "row-bad", seed=4)
            good = _submit(tiny_llm, "row-good", seed=5)
        end = _end(bad)
        assert isinstance(end, Failed) and isinstance(end.error, StepFailedError)
        assert collect(good).token_ids == alone
    finally:
        scheduler.steps.fault = None
    assert _until(scheduler, lambda: not any(scheduler.snapshot()["slots"]))
    assert _pages_all_back(scheduler.engine)


def test_a_state_that_cannot_be_rebuilt_breaks_the_engine(tiny_llm):
    """A failed step whose decode state cannot be rebuilt: the engine is broken (the health
    problem says so, new requests get EngineBrokenError, 503) until the state is rebuilt
    (here by the test; in a server, by a restart)."""
    from metrale_jax.scheduler.watchdog import EngineBrokenError
    scheduler = tiny_llm.scheduler
    engine = scheduler.engine
    real_step, real_init = type(engine).step, type(engine).init_decode_state

    def step(*args, **kwargs):
        raise RuntimeError("injected step fault")

    def init_decode_state():
        raise RuntimeError("injected device loss")

    engine.step, engine.init_decode_state = step, init_decode_state
    try:
        end = _end(_submit(tiny_llm, "broken-first"))
        assert isinstance(end, Failed) and isinstance(end.error, StepFailedError)
        assert "could not be rebuilt" in scheduler.health.problem
        assert "injected device loss" in scheduler.health.problem
        with pytest.raises(EngineBrokenError) as e:
            _submit(tiny_llm, "broken-refused", seed=1)
        assert e.value.status == 503
    finally:
        del engine.step, engine.init_decode_state
        assert (type(engine).step, type(engine).init_decode_state) == (real_step, real_init)
        scheduler.steps.reset_state()  # (the loop is idle: nothing runs)
        scheduler.health.failures.broken = None
        scheduler.health.failures.in_a_row = 0
    assert collect(_submit(tiny_llm, "broken-after", seed=2)).finish_reason == "length"
