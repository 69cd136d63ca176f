"""Progress of long stages: plain lines off a terminal, rich bars on one, and the runtime's
stages (with the engine's and loader's step hooks when they offer them)."""

from __future__ import annotations

import io
import re

import pytest

from serving.progress import StageProgress, accepts_keyword, progress_kwargs, stage

# its runtimes have the shared server's shapes: same worker, programs from the cache
pytestmark = pytest.mark.xdist_group("tiny-server")


def plain(fn) -> list[str]:
    out = io.StringIO()
    with StageProgress(stream=out, tty=False) as progress:
        fn(progress)
    return [re.sub(r"\d+\.\d s", "T s", line) for line in out.getvalue().splitlines()]


def test_plain_lines_at_start_quarters_and_end():
    def work(progress):
        with stage(progress, "loading weights") as step:
            for i in range(1, 9):
                step(i, 8)
        with stage(progress, "compiling"):
            pass

    assert plain(work) == ["metrale: loading weights ...", "metrale: loading weights: 2/8",
                           "metrale: loading weights: 4/8", "metrale: loading weights: 6/8",
                           "metrale: loading weights: 8/8 done in T s",
                           "metrale: compiling ...", "metrale: compiling: done in T s"]


def test_a_failed_stage_is_not_reported_done():
    def work(progress):
        with pytest.raises(ValueError), stage(progress, "compiling"):
            raise ValueError("boom")

    assert plain(work) == ["metrale: compiling ..."]


def test_bars_on_a_terminal():
    out = io.StringIO()
    with StageProgress(stream=out, tty=True) as progress:
        with stage(progress, "loading weights") as step:
            step(3, 3)
        with stage(progress, "compiling"):
            pass
    text = out.getvalue()
    assert re.search(r"loading weights\s+━+\s+3/3", text)
    assert re.search(r"compiling\s+━+\s+1/1", text)


def test_keyword_detection():
    def with_hook(path, dtype=None, *, progress=None): ...
    def without(path, dtype=None): ...
    def anything(*args, **kwargs): ...
    step = print
    assert accepts_keyword(with_hook, "progress") and accepts_keyword(anything, "progress")
    assert not accepts_keyword(without, "progress")
    assert progress_kwargs(with_hook, step) == {"progress": step}
    assert progress_kwargs(without, step) == {} and progress_kwargs(with_hook, None) == {}


def test_runtime_reports_its_stages_and_the_hooks_steps(tiny_model, monkeypatch):
    """With a loader and an engine that take `progress` (the hooks asked of them), their
    steps come through inside the runtime's "loading weights" and "compiling" stages."""
    from metrale_jax.engine import Engine
    from metrale_jax.weights import checkpoint
    from serving.http.runtime import ModelRuntime
    from serving.http.settings import ServerSettings
    from tests.serving.conftest import MAX_LEN

    real_load, real_warmup = checkpoint.load_checkpoint, Engine.warmup

    def load(model, dtype=None, progress=None, **kwargs):
        ckpt = real_load(model, dtype, **kwargs)  # the placement hook included
        progress(1, 2)
        progress(2, 2)
        return ckpt

    def warmup(self, workers=2, progress=None):
        seconds = real_warmup(self, workers)
        progress(self.compile_count, self.compile_count)
        return seconds

    monkeypatch.setattr(checkpoint, "load_checkpoint", load)
    monkeypatch.setattr(Engine, "warmup", warmup)
    seen = []
    settings = ServerSettings(model=str(tiny_model), max_slots=8, max_len=MAX_LEN,
                              engine_options={"max_prefill_len": 64}, warmup="full")
    runtime = ModelRuntime(settings, progress=lambda *a: seen.append(a))
    runtime.start().join(600)
    try:
        assert runtime.ready, runtime.error
        n = runtime.scheduler.engine.compile_count
        assert seen == [("loading weights", 0, 0), ("loading weights", 1, 2),
                        ("loading weights", 2, 2), ("loading weights", 2, 2),
                        ("compiling", 0, 0), ("compiling", n, n), ("compiling", n, n)]
    finally:
        runtime.stop()


def test_runtime_fails_when_warmup_fails(tiny_model, monkeypatch):
    """An engine whose warmup raises leaves the runtime "failed" with that error (so /health
    stays 503 and requests get `load_failed`), never "ready"."""
    from metrale_jax.engine import Engine
    from serving.http.runtime import ModelRuntime
    from serving.http.settings import ServerSettings
    from tests.serving.conftest import MAX_LEN

    def warmup(self, workers=2, progress=None):
        raise RuntimeError("compile failed on purpose")

    monkeypatch.setattr(Engine, "warmup", warmup)
    settings = ServerSettings(model=str(tiny_model), max_slots=8, max_len=MAX_LEN,
                              engine_options={"max_prefill_len": 64}, warmup="full")
    runtime = ModelRuntime(settings)
    runtime.start().join(600)
    try:
        assert runtime.state == "failed" and not runtime.ready
        assert "compile failed on purpose" in str(runtime.error)
    finally:
        runtime.stop()
