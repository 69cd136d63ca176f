"""The step-time model: how long a ragged step of a given shape takes, for the latency target.

A step with a chunk runs n decode rows (a mixed row bucket) and a chunk of C prompt tokens (a
chunk bucket); its time is modelled as

    t(n, C, late, ctx) = base[n, C, late] + beta * ctx

where `late` says whether a piece attends to positions before it (a long prompt's later
piece, a piece after a shared prefix: the chunk then reads the pages, which costs a step a
large fixed part on XLA:CPU, 16-token pieces took 3x their fresh time), `base` is the time of
that compiled shape (for a late one: its intercept) and `ctx` the FLOPs of the pieces'
attention to their contexts (`StepCost.context_flops`), which grows with the context. A
decode-only step is the shape (n, 0, False).

Where the numbers come from:
- a prior from FLOPs (`StepCost`) at an assumed rate, for shapes not measured yet;
- `measure`, after warmup: each compiled mixed shape runs on a scratch state (the programs
  warmup compiled; nothing new compiles) with a fresh piece of C tokens, then with a piece of
  C tokens after those C positions (late); one uncounted pass over the shapes first (a
  program's first run pays one-time costs), and of the counted runs the fastest counts;
- online, `observe`: every step the loop reads gives its real time (`StepClock`), and the
  model follows it by an exponential moving average, per shape for `base` (steps whose
  context term is small) and for `beta` (steps where it dominates). Why an EWMA of the two
  terms rather than one ratio actual/predicted per shape: a shape's fixed cost and its
  context's cost scale differently (a later piece's context grows every step), so one ratio
  per shape would chase the context; and rather than a least-squares fit over a window: one
  multiply-add per step, and it follows a machine whose load changes (other processes, the
  grid compiling in the background) within a few steps.

The gate (`StepTimes.target_s`, `chunk_limit` and `fits`, used by `ChunkPlanner`): while rows
decode, each step's chunk is sized so that the predicted time stays within the tightest
target of the decoding rows (each request's `max_itl_ms`, clamped to [`FLOOR_MS`, the
server's target]); the smallest chunk bucket may always run, so prompts progress. With no
row decoding nothing is gated.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import statistics
import time
from collections.abc import Iterable
from typing import Any

import numpy as np

from metrale_jax.engine import Piece

log = logging.getLogger(__name__)

DEFAULT_MAX_ITL_MS = 250.0
"""The server's default latency target (ms): measured on the default model (SmolLM2-135M,
2 CPU cores, `--max-slots 4 --max-len 4096`): a decoding stream's worst gap while a long
prompt is admitted stays within about 10x its median (docs/performance.md, "Latency target"
and "Latency target and long prompts together": 300 ms left an 8,000-token prompt's stall at
10.7x, 250 ms at 10.1x)."""

FLOOR_MS = 20.0
"""The lowest target a request may ask for (ms): a streaming reader notices no gap below
about 20 ms (50 tokens/s), and a lower target would only shrink every chunk to the smallest
bucket, slowing every other request's prompt for no gain anyone sees."""

Key = tuple[int, int, bool]
"""A step shape: (decode rows n, chunk bucket C, late: some piece attends to a context)."""

ALPHA = 0.25
"""Weight of a new measurement in the moving averages (about the last 4-8 steps count)."""

PRIOR_FLOPS_PER_S = 2e10
"""The assumed rate of a step's matmuls before anything was measured."""

CONTEXT_SLOWDOWN = 4.0
"""The prior ratio of a context FLOP's time to a matmul FLOP's (attention to the pages runs
at about a quarter of the matmuls' efficiency on XLA:CPU)."""

OVERHEAD_S = 0.002
"""The prior fixed time of one step (dispatch, sampling, host work)."""


def check_target(value: float | None, param: str = "max_itl_ms") -> float | None:
    """`value` (ms) if it is a finite number > 0, or None; raises `InvalidParameterError`."""
    from metrale_jax.errors import InvalidParameterError
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
            math.isfinite(value) and value > 0):
        raise InvalidParameterError(f"{param} must be a number of milliseconds > 0, not "
                                    f"{value!r}", param=param)
    return float(value)


@dataclasses.dataclass
class ShapeRecord:
    """What one step shape (n, C) has shown: steps observed, and the moving averages of their
    predicted and actual seconds (for `/v1/metrale/stats`)."""

    steps: int = 0
    predicted: float = 0.0
    actual: float = 0.0

    def add(self, predicted: float, actual: float) -> None:
        """Adds one step's prediction and measured time (seconds)."""
        if not self.steps:
            self.predicted, self.actual = predicted, actual
        else:
            self.predicted += ALPHA * (predicted - self.predicted)
            self.actual += ALPHA * (actual - self.actual)
        self.steps += 1


class StepTimes:
    """The step-time model of one engine and the latency gate built on it.

    Args:
        engine: the `Engine` (`config`: row and chunk buckets; `step_cost`; `model_config`).
        max_itl_ms: the server's target in ms (None or 0: no gate; each request may ask for a
            tighter one, not a looser one).
    """

    def __init__(self, engine: Any, max_itl_ms: float | None = DEFAULT_MAX_ITL_MS):
        cfg = engine.config
        self.cost = engine.step_cost
        self.rows = tuple(cfg.mixed_row_buckets)
        self.decode_rows = tuple(cfg.active_slot_buckets)
        self.buckets = tuple(cfg.chunk_buckets)
        self.target_ms = float(max_itl_ms) if max_itl_ms else None
        layers = len(self.cost.windows)
        self._flops_per_token = self.cost.token_flops * layers
        self.base: dict[Key, float] = {}  # measured or learnt (seconds)
        self.beta = CONTEXT_SLOWDOWN / PRIOR_FLOPS_PER_S  # seconds per context FLOP
        self.records: dict[Key, ShapeRecord] = {}
        self.measured_at_warmup: dict[Key, float] = {}

    # ---- the model ---------------------------------------------------------------------
    def _rate(self) -> float:
        """FLOPs per second of the measured shapes (the median), or the prior's."""
        rates = [self.cost.piece_flops(C, 0) / t for (n, C, late), t in self.base.items()
                 if C and not late and t > 0]
        return statistics.median(rates) if rates else PRIOR_FLOPS_PER_S

    def _base(self, n: int, C: int, late: bool = False) -> float:
        """base[n, C, late] (seconds): learnt, or (late) the fresh shape's, or from the FLOPs
        of n + C tokens at the measured rate (C = 0: one decode step's n tokens)."""
        got = self.base.get((n, C, late))
        if got is not None:
            return got
        if late:
            return self._base(n, C)
        flops = (self.cost.piece_flops(C, 0) if C else 0.0) + n * self._flops_per_token
        return OVERHEAD_S + flops / self._rate()

    def predict(self, n: int, C: int, context_flops: float = 0.0, late: bool = False) -> float:
        """Predicted seconds of the step with n decode rows, a chunk bucket C (0: decode only)
        and pieces whose attention to their context costs `context_flops` (`late`: some piece
        has a context)."""
        return self._base(n, C, late) + self.beta * context_flops

    def observe(self, n: int, C: int, context_flops: float, seconds: float,
                late: bool = False) -> None:
        """Corrects the model by one measured step (see the module docstring): `base[n, C,
        late]` when the context term is under a quarter of the prediction, else `beta`. One
        sample moves a term by at most 3x (a step delayed by something else counts little)."""
        key = (n, C, late)
        predicted = self.predict(n, C, context_flops, late)
        self.records.setdefault(key, ShapeRecord()).add(predicted, seconds)
        context = self.beta * context_flops
        base = self._base(n, C, late)
        if context < 0.25 * predicted or context_flops <= 0:
            sample = min(max(seconds - context, base / 3), base * 3)
            self.base[key] = base + ALPHA * (sample - base) if key in self.base else sample
        else:
            sample = min(max((seconds - base) / context_flops, self.beta / 3), self.beta * 3)
            self.beta += ALPHA * (sample - self.beta)

    # ---- the gate ----------------------------------------------------------------------
    def target_s(self, requested_ms: Iterable[float | None]) -> float | None:
        """The tightest target (seconds) of the decoding rows: each row's own `max_itl_ms`
        clamped to [FLOOR_MS, the server's target], or the server's; None when the server
        has none (no gate)."""
        if self.target_ms is None:
            return None
        tightest = self.target_ms
        for ms in requested_ms:
            if ms is not None:
                tightest = min(tightest, max(FLOOR_MS, ms))
        return tightest / 1000.0

    def mixed_rows(self, top: int) -> int:
        """The mixed row bucket n of a step whose highest decoding slot is `top - 1`."""
        return next((r for r in self.rows if top <= r), self.rows[-1])

    def chunk_limit(self, n: int, target: float, limit: int) -> int:
        """The largest chunk bucket (at most `limit` tokens) whose step with fresh pieces
        beside n decode rows is predicted within `target` seconds; the smallest bucket when
        none is."""
        fits = [c for c in self.buckets if c <= limit and self.predict(n, c) <= target]
        return fits[-1] if fits else self.buckets[0]

    def fits(self, n: int, tokens: int, context_flops: float, late: bool,
             target: float) -> bool:
        """True when a step of n rows carrying `tokens` prompt tokens (in the chunk bucket that
        holds them) whose pieces' context costs `context_flops` (`late`: some piece has a
        context) is predicted within `target` seconds."""
        C = next((c for c in self.buckets if tokens <= c), self.buckets[-1])
        return self.predict(n, C, context_flops, late) <= target

    # ---- warmup measurement --------------------------------------------------------------
    def measure(self, engine: Any, state: Any, ready: Any = None, runs: int = 1) -> Any:
        """Times each mixed step shape (n, C) on `state` (a scratch decode state; rows are
        written and released: call `engine.init_decode_state()` afterwards): a fresh piece of
        C tokens, then a late piece of C tokens after those C positions (its intercept counts:
        the time less `beta` times its context FLOPs). One uncounted pass over the shapes
        first (a program's first run pays one-time costs), then `runs` passes; of each
        shape's runs the fastest counts: other processes only ever add time, and the online
        correction follows the machine's load. ready(n, C): whether that shape is compiled
        (None: all are); shapes not ready are skipped (the FLOP prior and the online
        correction cover them). Returns the state."""
        B, S = engine.config.max_slots, engine.config.max_len
        shapes = [(n, C) for n in self.rows for C in self.buckets
                  if n <= B and (ready is None or ready(n, C))]
        got: dict[Key, list[float]] = {}
        for counted in [False] + [True] * max(1, runs):
            for n, C in shapes:
                engine.release(0)
                state, seconds = timed_step(engine, state, n, [Piece(0, (1,) * C, 0, None)])
                if counted:
                    got.setdefault((n, C, False), []).append(seconds)
                if 2 * C < S:  # a prompt leaves room for a token: at most S - 1
                    state, seconds = timed_step(engine, state, n, [Piece(0, (1,) * C, C, None)])
                    if counted:
                        got.setdefault((n, C, True), []).append(seconds)
        engine.release(0)
        for (n, C, late), times in got.items():
            seconds = self.measured_at_warmup[(n, C, late)] = min(times)
            self.base[(n, C, late)] = (max(seconds - self.beta * self.cost.context_flops(C, C),
                                           0.0) if late else seconds)
        log.info("step times at warmup (ms; rows, chunk, late): %s",
                 {k: round(v * 1e3, 1) for k, v in self.measured_at_warmup.items()})
        return state

    # ---- report ------------------------------------------------------------------------
    def report(self) -> dict[str, Any]:
        """For `/v1/metrale/stats`: `{"max_itl_ms", "floor_ms", "context_s_per_gflop",
        "shapes": [{"rows", "chunk", "late", "measured_at_warmup_ms", "predicted_ms",
        "actual_ms", "steps"}]}` (late: pieces with a context; predicted and actual: moving
        averages over the steps observed)."""
        shapes = []
        records, warmup = dict(self.records), dict(self.measured_at_warmup)  # (any thread)
        for key in sorted(set(records) | set(warmup)):
            rec = records.get(key, ShapeRecord())
            warm = warmup.get(key)
            shapes.append({
                "rows": key[0], "chunk": key[1], "late": key[2],
                "measured_at_warmup_ms": round(warm * 1e3, 2) if warm is not None else None,
                "predicted_ms": round(rec.predicted * 1e3, 2) if rec.steps else
                round(self.predict(key[0], key[1], 0.0, key[2]) * 1e3, 2),
                "actual_ms": round(rec.actual * 1e3, 2) if rec.steps else None,
                "steps": rec.steps})
        return {"max_itl_ms": self.target_ms, "floor_ms": FLOOR_MS,
                "context_s_per_gflop": round(self.beta * 1e9, 4), "shapes": shapes}


def timed_step(engine: Any, state: Any, n: int, pieces: list[Piece]) -> tuple[Any, float]:
    """Runs one step of `pieces` (on slot 0) beside decode rows 1 .. n-1 (their shape: n
    rows) and waits for it; returns the state and the seconds it took."""
    B = engine.config.max_slots
    active = np.zeros(B, np.bool_)
    active[1:n] = True
    t0 = time.perf_counter()
    state, out = engine.step(state, active, None, pieces)
    np.asarray(out.tokens)
    seconds = time.perf_counter() - t0
    for b in range(1, n):
        engine.release(b)
    return state, seconds


@dataclasses.dataclass
class _Launched:
    """One launched step's timing: its shape, when it was launched, whether it queued behind
    the step before it (`after`: that step's record), and when its output was seen ready
    (None: unknown, it was ready before the loop looked)."""

    shape: Key
    context_flops: float
    launched: float
    after: _Launched | None
    ready: float | None = None


class StepClock:
    """Measures real step times although steps run asynchronously and are read one late.

    A step's time is from its start to its output being ready. Its start: its launch (the
    host's work for it included) when the step before it was done by then, else the moment
    that one's output was ready (the device stayed busy). Its end: when the loop, waiting for
    its output, got it; a step whose output was ready before the loop looked has no known end
    (no sample: it would count the loop's own delay), nor then has the step queued after it.
    In the decoding loop the loop waits for nearly every step, so nearly every step counts.
    """

    def __init__(self, times: StepTimes):
        self.times = times
        self._last: _Launched | None = None
        self._last_output: Any = None

    def start(self) -> tuple[float, _Launched | None]:
        """Call just before a step is launched: (now, the step it queues behind, or None when
        the previous step is already done)."""
        now = time.perf_counter()
        prev = self._last
        if prev is not None and self._last_output is not None and \
                not _is_ready(self._last_output):
            return now, prev
        return now, None

    def launched_step(self, started: tuple[float, _Launched | None], output: Any,
                      shape: Key, context_flops: float) -> _Launched:
        """Records the step launched at `started` (`start()`'s value) with its `output`."""
        rec = _Launched(shape, context_flops, started[0], started[1])
        self._last, self._last_output = rec, output
        return rec

    def read(self, rec: _Launched | None, output: Any) -> None:
        """Waits for `output` (the step of `rec`) and feeds its time to the model."""
        if rec is None:
            return
        was_ready = _is_ready(output)
        np.asarray(output.tokens)
        if was_ready:
            return
        rec.ready = time.perf_counter()
        if rec.after is None:
            start = rec.launched
        elif rec.after.ready is not None:
            start = max(rec.launched, rec.after.ready)
        else:
            return
        n, C, late = rec.shape
        self.times.observe(n, C, rec.context_flops, rec.ready - start, late)

    def forget(self) -> None:
        """Drops the record of the last step (the loop failed and its steps were cleared)."""
        self._last = self._last_output = None


def _is_ready(output: Any) -> bool:
    """True when a step's output (`StepOutput`) is computed."""
    tokens = getattr(output, "tokens", None)
    is_ready = getattr(tokens, "is_ready", None)
    return bool(is_ready()) if is_ready is not None else True
