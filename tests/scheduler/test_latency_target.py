"""The latency target (scheduler/step_time.py): the step-time model, its online correction, the
step clock, and the chunk sizes the gate lets ride beside decoding rows.

The loop tests hold the engine inside its step (tests/step_gate.py) and look at the prompt
tokens each step carried; the model's times are set by the test and its online correction is
held, so nothing depends on how fast this machine is.
"""

from __future__ import annotations

import itertools
import types

import numpy as np
import pytest

from metrale_jax import SamplingParams
from metrale_jax.errors import InvalidParameterError
from metrale_jax.scheduler import GenerationRequest
from metrale_jax.scheduler.step_time import FLOOR_MS, StepClock, StepTimes
from tests.step_gate import StepGate

STREAM = SamplingParams(max_tokens=100, temperature=0, ignore_eos=True)
ONE = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def itl_llm(tiny_folder):
    """The tiny model with chunk buckets 16 and 64 (4 slots, max_len 256), target 100 ms."""
    from metrale_jax import LLM
    llm = LLM(tiny_folder, max_slots=4, max_len=256, max_prefill_len=64,
              min_prefill_bucket=16, max_prefill_batch=2, max_itl_ms=100)
    _ = llm.scheduler
    yield llm
    llm.close()


def _held_model(llm, times: dict[int, float]):
    """Sets the model's fresh and late time of every mixed shape (chunk -> seconds, any
    rows) and holds its online correction (the test decides what is predicted)."""
    model = llm.scheduler.step_times
    for n in model.rows:
        for c, t in times.items():
            model.base[(n, c, False)] = model.base[(n, c, True)] = t
    model.beta = 0.0
    model.observe = lambda *a, **k: None  # type: ignore[method-assign]
    return model


def _record_chunks(engine) -> list[tuple[int, int]]:
    """Wraps `engine.step` (before a `StepGate` does): each call appends (decoding rows,
    prompt tokens)."""
    seen: list[tuple[int, int]] = []
    real = engine.step

    def step(state, active=None, allowed=None, pieces=()):
        rows = int(np.count_nonzero(active)) if active is not None else 0
        seen.append((rows, sum(len(p.tokens) for p in pieces)))
        return real(state, active, allowed, pieces)
    engine.step = step
    return seen


_seeds = itertools.count()


def _prompt(n: int) -> list[int]:
    """A prompt no earlier test sent (nothing of it is in the prefix cache)."""
    return np.random.default_rng(next(_seeds)).integers(3, 1000, n).tolist()


def _run_with_a_stream(llm, long_len: int, long_itl: float | None = None,
                       stream_itl: float | None = None) -> list[tuple[int, int]]:
    """A stream decodes; a `long_len`-token prompt arrives; the steps until it ends are
    recorded as (decoding rows, prompt tokens)."""
    engine = llm.scheduler.engine
    seen = _record_chunks(engine)
    gate = StepGate(engine)
    try:
        stream = llm.scheduler.submit(GenerationRequest.make(
            _prompt(8), STREAM, max_itl_ms=stream_itl))
        assert gate.entered.wait(60)
        gate.next()  # its prompt; it decodes from the next step on
        long = llm.scheduler.submit(GenerationRequest.make(
            _prompt(long_len), ONE, max_itl_ms=long_itl))
        for _ in range(40):
            if long.done:
                break
            gate.next()
        assert long.done
        stream.cancel()
    finally:
        gate.open()  # (which also drops the recording wrapper)
    for _ in stream:
        pass
    return seen


def test_chunks_beside_a_decoding_stream_stay_within_the_target(itl_llm):
    """A 16-token chunk is predicted at 50 ms, a 64-token one at 400 ms, the target is 100 ms:
    while the stream decodes every step carries at most 16 prompt tokens, so the stream's
    worst step is the 50 ms one (not the 400 ms one it got before the target)."""
    _held_model(itl_llm, {16: 0.05, 64: 0.4})
    seen = _run_with_a_stream(itl_llm, 150)
    beside = [tokens for rows, tokens in seen if rows and tokens]
    assert beside and max(beside) <= 16
    assert sum(beside) >= 150 - 16  # the prompt went on, 16 tokens a step


def test_without_a_decoding_row_the_full_chunk_runs(itl_llm):
    """Nothing decodes: the prompt's steps carry 64 tokens (the largest bucket), although a
    64-token step is predicted over the target."""
    _held_model(itl_llm, {16: 0.05, 64: 0.4})
    engine = itl_llm.scheduler.engine
    seen = _record_chunks(engine)
    try:
        for _ in itl_llm.scheduler.submit(GenerationRequest.make(_prompt(150), ONE)):
            pass
    finally:
        del engine.step
    chunks = [tokens for rows, tokens in seen if tokens]
    assert chunks[:2] == [64, 64]


def test_a_chunk_that_fits_the_target_rides_with_the_stream(itl_llm):
    """A 64-token step predicted at 80 ms fits the 100 ms target: full chunks beside the
    stream; a request asking for 60 ms brings it down to 16-token chunks."""
    _held_model(itl_llm, {16: 0.03, 64: 0.08})
    beside = [t for r, t in _run_with_a_stream(itl_llm, 150) if r and t]
    assert max(beside) == 64
    beside = [t for r, t in _run_with_a_stream(itl_llm, 150, stream_itl=60) if r and t]
    assert max(beside) <= 16


def test_the_smallest_bucket_always_runs(itl_llm):
    """Even a 16-token step is predicted over the target: prompts still progress by 16."""
    _held_model(itl_llm, {16: 0.5, 64: 2.0})
    beside = [t for r, t in _run_with_a_stream(itl_llm, 60) if r and t]
    assert beside and max(beside) == 16


def test_a_request_target_is_clamped_to_the_floor_and_the_server_target(itl_llm):
    model = itl_llm.scheduler.step_times
    assert model.target_s([None]) == pytest.approx(0.1)
    assert model.target_s([1.0]) == pytest.approx(FLOOR_MS / 1000)
    assert model.target_s([5000.0]) == pytest.approx(0.1)  # never looser than the server's
    assert model.target_s([60.0, None, 80.0]) == pytest.approx(0.06)
    for bad in (0, -5, float("nan"), float("inf"), "fast", True):
        with pytest.raises(InvalidParameterError) as e:
            itl_llm.scheduler.submit(GenerationRequest.make(_prompt(4), ONE, max_itl_ms=bad))
        assert e.value.param == "max_itl_ms"


def test_no_target_gates_nothing():
    assert _model(None).target_s([50.0]) is None
    assert _model(0).target_s([50.0]) is None


def _cost():
    from metrale_jax.config import ModelConfig
    from metrale_jax.engine.step_cost import StepCost
    cfg = ModelConfig("llama", vocab_size=512, hidden_size=64, intermediate_size=128,
                      num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16)
    return StepCost(cfg, (16, 64))


def _model(target: float | None = 100) -> StepTimes:
    """A model of an engine with row buckets 1 and 4 and chunk buckets 16 and 64."""
    engine = types.SimpleNamespace(config=types.SimpleNamespace(
        mixed_row_buckets=(1, 4), active_slot_buckets=(1, 2, 4), chunk_buckets=(16, 64)),
        step_cost=_cost())
    return StepTimes(engine, target)


def test_the_model_follows_real_step_times():
    """Measured times move the shape's base (context term small) or the context coefficient
    (context term large) towards them; one outlier moves a term at most 3x."""
    model = _model()
    model.base[(4, 64, False)] = 0.1
    for _ in range(30):
        model.observe(4, 64, 0.0, 0.2)
    assert model.predict(4, 64) == pytest.approx(0.2, rel=0.01)
    model.observe(4, 64, 0.0, 100.0)  # one step delayed by something else
    assert model.predict(4, 64) < 0.2 * 3
    # a late shape: its intercept, then the context's cost per FLOP
    model.base[(4, 16, True)] = 0.05
    flops = 1e9
    for _ in range(40):
        model.observe(4, 16, flops, 0.05 + 0.3, late=True)
    assert model.predict(4, 16, flops, late=True) == pytest.approx(0.35, rel=0.05)
    assert model.predict(4, 16, 2 * flops, late=True) > 0.6
    shapes = {(s["rows"], s["chunk"], s["late"]): s for s in model.report()["shapes"]}
    assert shapes[(4, 64, False)]["steps"] == 31 and shapes[(4, 16, True)]["steps"] == 40


def test_unmeasured_shapes_scale_with_flops():
    """Before a shape is measured its time comes from the measured ones' FLOP rate; a late
    shape not measured takes its fresh shape's time."""
    model = _model()
    model.base[(1, 16, False)] = 0.01
    assert model.predict(1, 64) > 2 * model.predict(1, 16)
    assert model.predict(1, 16, 0.0, late=True) == pytest.approx(0.01)


class _Output:
    """A step output whose readiness the test sets."""

    def __init__(self, ready: bool):
        self.tokens = self
        self.ready = ready

    def is_ready(self) -> bool:
        return self.ready

    def __array__(self, dtype=None, copy=None):
        return np.zeros((1, 1), np.int32)


def test_the_step_clock_counts_only_steps_it_saw_end(monkeypatch):
    """A step that queued behind the one before it starts when that one ended; a step whose
    output was ready before the loop looked gives no sample, nor does the one behind it."""
    import metrale_jax.scheduler.step_time as st
    clock_times = iter([0.0, 0.010, 0.100, 0.130, 0.300, 0.310, 0.500, 0.600])
    monkeypatch.setattr(st.time, "perf_counter", lambda: next(clock_times))
    seen = []
    model = types.SimpleNamespace(observe=lambda n, c, f, s, late: seen.append(round(s, 3)))
    clock = StepClock(model)  # type: ignore[arg-type]
    a_out, b_out = _Output(False), _Output(False)
    a = clock.launched_step(clock.start(), a_out, (1, 16, False), 0.0)  # t = 0
    b = clock.launched_step(clock.start(), b_out, (1, 16, False), 0.0)  # t = 0.010, behind a
    clock.read(a, a_out)  # ends at 0.100: 0.100 s
    clock.read(b, b_out)  # ends at 0.130, started at 0.100: 0.030 s
    assert seen == [0.1, 0.03]
    c_out, d_out = _Output(False), _Output(False)
    c = clock.launched_step(clock.start(), c_out, (1, 16, False), 0.0)  # t = 0.300
    d = clock.launched_step(clock.start(), d_out, (1, 16, False), 0.0)  # t = 0.310, behind c
    c_out.ready = True  # done before the loop looked: its end is unknown
    clock.read(c, c_out)
    clock.read(d, d_out)  # behind a step of unknown end: no sample either
    assert seen == [0.1, 0.03]
