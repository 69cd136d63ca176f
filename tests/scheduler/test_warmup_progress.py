"""`Scheduler(warmup_progress=...)` passes the callback to `engine.warmup(progress=...)`, and
calls a plain `engine.warmup()` when none is given."""

from __future__ import annotations

from types import SimpleNamespace

from metrale_jax.scheduler import Scheduler


class Engine:
    """Just what the loop touches before its first request."""

    config = SimpleNamespace(max_slots=2, max_len=16)
    model_config = SimpleNamespace(vocab_size=64)

    def __init__(self):
        self.calls = []

    def warmup(self, workers: int = 2, progress=None):
        self.calls.append(progress)
        for done in range(1, 4):
            if progress is not None:
                progress(done, 3)
        return 0.0

    def init_decode_state(self):
        return None


class OldEngine(Engine):
    def warmup(self, workers: int = 2):  # no progress parameter
        self.calls.append("plain")
        return 0.0


def test_progress_reaches_the_engine():
    seen = []
    engine = Engine()
    scheduler = Scheduler(engine, tokenizer=None, warmup_progress=lambda d, t: seen.append((d, t)))
    try:
        assert scheduler.wait_ready(30)
    finally:
        scheduler.stop()
    assert seen == [(1, 3), (2, 3), (3, 3)]


def test_without_progress_warmup_is_called_as_before():
    engine = OldEngine()
    scheduler = Scheduler(engine, tokenizer=None)
    try:
        assert scheduler.wait_ready(30)
        assert scheduler.snapshot() == {"slots": [None, None], "waiting": 0,
                                        "waiting_by_tenant": {}, "stats": {}}
    finally:
        scheduler.stop()
    assert engine.calls == ["plain"]


class BrokenEngine(Engine):
    def warmup(self, workers: int = 2, progress=None):
        raise RuntimeError("out of device memory while compiling")


def test_a_failed_warmup_is_not_ready_and_says_why():
    scheduler = Scheduler(BrokenEngine(), tokenizer=None)
    try:
        assert not scheduler.wait_ready(30)
        assert not scheduler.ready
        assert "out of device memory" in str(scheduler.startup_error)
    finally:
        scheduler.stop()
