"""The step-time model's warmup measurement against the steps it predicts, on a tiny engine.

Each mixed shape (rows, chunk, fresh or late) is measured by `StepTimes.measure` as after a
warmup; then the same steps run again over the grid, and the fastest of their times must lie
within 25% of the prediction (the fastest, as the measurement takes: a step delayed by another
process on a shared machine does not decide; the online correction, tested in
tests/scheduler/test_latency_target.py, follows the load).

Measurement and check alternate in rounds of a few milliseconds each, and a shape's ratio is
the median over the rounds: a stretch of time in which another process holds a core (under
`pytest -n 3` on two cores) slows one round's measurement or its check, not the median, so
the bound is the model's error rather than the machine's load at one moment.
"""

from __future__ import annotations

import statistics

from metrale_jax.engine import Piece
from metrale_jax.scheduler.step_time import StepTimes, timed_step

ROUNDS = 7
RUNS = 8  # per shape and round, on each side: the fastest counts


def test_predictions_within_25_percent_of_measured_steps(tiny_engine):
    engine = tiny_engine
    state = engine.init_decode_state()
    cost = engine.step_cost
    ratios: dict[tuple, list[float]] = {}
    for _ in range(ROUNDS):
        model = StepTimes(engine, 100)
        state = model.measure(engine, state, runs=RUNS)
        shapes = [(n, c, late) for n in model.rows for c in model.buckets
                  for late in (False, True)]
        assert set(model.measured_at_warmup) == set(shapes)
        got: dict[tuple, list[float]] = {s: [] for s in shapes}
        for _ in range(RUNS):
            for n, c, late in shapes:
                engine.release(0)
                if late:
                    state, _ = timed_step(engine, state, n, [Piece(0, (1,) * c, 0, None)])
                piece = Piece(0, (1,) * c, c if late else 0, None)
                state, seconds = timed_step(engine, state, n, [piece])
                got[(n, c, late)].append(seconds)
        engine.release(0)
        for (n, c, late), times in got.items():
            predicted = model.predict(n, c, cost.context_flops(c, c) if late else 0.0, late)
            ratios.setdefault((n, c, late), []).append(predicted / min(times))
    engine.init_decode_state()
    off = {shape: statistics.median(r) for shape, r in ratios.items()}
    assert all(0.75 <= r <= 1.25 for r in off.values()), off
