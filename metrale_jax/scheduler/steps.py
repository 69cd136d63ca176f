"""The steps in flight: launching each ragged step and reading its output one step late.

A step runs every decoding row's next token(s) plus the chunk of prompt pieces that
`ChunkPlanner` chose (or, when rows may draft and no prompt is being prefilled, a verify step
of `Speculation`). Its output starts copying to the host at once and is read on a later
iteration (`read`), so the device is never idle while Python detokenizes: each owner row's
tokens go to its sequence, a beam row's top list to its search (`BeamRows`), a pooling
request's vector (`StepOutput.pooled`) to its caller as its `Pooled` end. Each step's real
time goes to the step-time model (`step_time.StepClock`), which `measure` also fills after
warmup.

A step whose launch or output read raises raises `StepFailureError` naming its requests (the
scheduler recovers: scheduler/step_failures.py); a row whose output alone raises while it is
handed out goes to `on_row_error` and the other rows go on.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable
from typing import Any

import numpy as np

from metrale_jax.scheduler.beam_rows import BeamRows
from metrale_jax.scheduler.chunks import ChunkPlanner
from metrale_jax.scheduler.events import Pooled
from metrale_jax.scheduler.grammar_slots import GrammarSlots
from metrale_jax.scheduler.rows import Pending, Rows
from metrale_jax.scheduler.sequence import Sequence
from metrale_jax.scheduler.speculation import Speculation
from metrale_jax.scheduler.step_failures import StepFailureError
from metrale_jax.scheduler.step_time import StepClock, StepTimes

log = logging.getLogger(__name__)


class StepRunner:
    """The decode state of one engine and its launched steps (loop thread only).

    Args:
        engine: the `Engine` (`step`, `init_decode_state`, `pages`, `lengths`).
        rows, grammar, chunks, beams, speculation: the scheduler's parts.
        stats: the scheduler's counters ("steps", "tokens", "finished").
        times: the step-time model fed with each step's real time (None: none).

    Attributes:
        state: the engine's `DecodeState` (None until `reset_state`).
        pending: the launched steps not read yet, oldest first.
        on_read: called after each step's output was read (the loop's progress).
        on_row_error: `on_row_error(slot, seq, error)` when handing out one row's output
            raised (None: the error propagates).
        fault: fault injection (tests): `fault(seq)` is called for each row before its
            output is handed out; what it raises is that row's error.
    """

    def __init__(self, engine: Any, rows: Rows, grammar: GrammarSlots, chunks: ChunkPlanner,
                 beams: BeamRows, speculation: Speculation, stats: collections.Counter,
                 times: StepTimes | None = None):
        self.engine = engine
        self.rows = rows
        self.grammar = grammar
        self.chunks = chunks
        self.beams = beams
        self.speculation = speculation
        self.stats = stats
        self.state: Any = None
        self.pending: collections.deque[Pending] = collections.deque()
        self.times = times
        self.clock = StepClock(times) if times is not None else None
        self._timing: dict[int, Any] = {}  # id(Pending) -> its StepClock record
        self.on_read: Callable[[], None] | None = None
        self.on_row_error: Callable[[int, Sequence, BaseException], None] | None = None
        self.fault: Callable[[Sequence], None] | None = None

    def measure(self) -> None:
        """Times each compiled mixed step shape once on a scratch state (`StepTimes.measure`,
        after warmup; an encoder-decoder's steps need sources: not measured), then starts
        from a fresh state. A failure is logged: the model keeps its prior."""
        if self.times is None or self.engine.sources is not None:
            return
        programs = self.engine.step_programs
        try:
            self.state = self.times.measure(self.engine, self.state,
                                            ready=lambda n, c: programs.ready(n, c, 1))
        except Exception:
            log.exception("could not time the step shapes")
        self.reset_state()

    def reset_state(self) -> None:
        """A fresh decode state (at start, and after a failed iteration)."""
        self.state = self.engine.init_decode_state()

    def clear(self) -> None:
        """Forgets the steps in flight and the beam rows not set (a failed iteration)."""
        self.pending.clear()
        self.beams.reset()
        self._timing.clear()
        if self.clock is not None:
            self.clock.forget()

    def drain(self) -> None:
        """Reads every launched step."""
        self.read(keep=0)

    def read(self, keep: int) -> None:
        """Reads launched steps, oldest first, until `keep` are left in flight."""
        while len(self.pending) > keep:
            self.consume(self.pending.popleft())

    def launch(self, preempt: Callable[[], bool]) -> bool:
        """Launches one ragged step: decoding rows plus prompt pieces; False when nothing
        can run. When a decoding row needs a page the pool cannot give, the steps in flight
        are read first (a victim's tokens must be known), then `preempt()` frees a row (it
        returns False when none could be freed)."""
        B = len(self.rows)
        engine = self.engine
        while True:
            active, allowed = self.grammar.step_inputs(self.rows.decoding())
            k = 1 if self.rows.prefilling else engine.config.decode_steps
            need = sum(engine.pages.shortfall(int(b), int(engine.lengths[b]) + k)
                       for b in np.flatnonzero(active))
            if need <= engine.pages.free_pages:
                break
            if self.pending:
                self.drain()
                continue
            if not preempt():
                return False
        pieces = self.chunks.plan(need, active) if self.rows.prefilling else []
        if not active.any() and not pieces:
            return False
        if not pieces and not self.pending:
            drafts = self.speculation.drafts(active)
            if drafts is not None:
                try:
                    self.state, launched = self.speculation.verify(self.state, active,
                                                                   allowed, drafts)
                except Exception as e:
                    raise StepFailureError(e, self.rows.decoding(), "launch") from e
                self.pending.append(launched)
                return True
        started = self.clock.start() if self.clock is not None else None
        try:
            self.state, out = engine.step(self.state, active, allowed,
                                          [p for p, _ in pieces])
            _start_copy(out)
        except Exception as e:
            seqs = [self.rows[int(b)] for b in np.flatnonzero(active)]
            raise StepFailureError(e, seqs + [seq for _, seq in pieces], "launch") from e
        timing = None
        if self.clock is not None:
            cost = engine.step_cost
            timing = self.clock.launched_step(
                started, out,
                (*engine.step_shape(active, sum(len(p.tokens) for p, _ in pieces)),
                 any(p.start for p, _ in pieces)),
                sum(cost.context_flops(len(p.tokens), p.start) for p, _ in pieces))
        self.stats["steps"] += 1
        owners = self.rows.decode_owners(active)
        r = 0
        for piece, seq in pieces:
            if piece.settings is not None:
                owners.append((B + r, piece.slot, seq))
                self.rows.prefilling.remove(piece.slot)
                r += 1
        self.grammar.launched(np.array([slot for _, slot, _ in owners], np.int64))
        launched = Pending(out, owners)
        self.pending.append(launched)
        if timing is not None:
            self._timing[id(launched)] = timing
        return True

    def consume(self, pending: Pending) -> None:
        """Reads a launched step's output: each owner row's tokens (`[k, B + r]`) go to its
        sequence (a beam row's top list to its search); finished rows are freed."""
        out = pending.output
        timing = self._timing.pop(id(pending), None)
        if self.clock is not None:
            self.clock.read(timing, out)
        try:
            tokens = np.asarray(out.tokens)
            logprobs = np.asarray(out.logprobs)
            top_ids = np.asarray(out.top_ids)
            top_lps = np.asarray(out.top_logprobs)
        except Exception as e:
            raise StepFailureError(e, [seq for _, _, seq in pending.owners], "output") from e
        B = len(self.rows)
        for col, slot, seq in pending.owners:
            if self.rows[slot] is not seq or seq.finished:
                continue
            try:
                self._hand_out(pending, col, slot, seq, B, tokens, logprobs, top_ids,
                               top_lps)
            except Exception as e:
                if self.on_row_error is None:
                    raise
                self.on_row_error(slot, seq, e)
        self.state = self.beams.flush(self.state)
        if self.on_read is not None:
            self.on_read()

    def _hand_out(self, pending: Pending, col: int, slot: int, seq: Sequence, B: int,
                  tokens: np.ndarray, logprobs: np.ndarray, top_ids: np.ndarray,
                  top_lps: np.ndarray) -> None:
        """Hands row `slot`'s output (column `col`) to its sequence."""
        out = pending.output
        if self.fault is not None:
            self.fault(seq)
        self.grammar.consumed(slot)
        if seq.request.pooling:
            self._end_pooled(slot, seq, np.asarray(out.pooled)[col - B],
                             np.asarray(out.pooled_mean)[col - B])
            return
        if seq.beam is not None:
            self.beams.output(seq, top_ids[0, col], top_lps[0, col])
            return
        steps = tokens.shape[0] if col < B else 1
        if pending.emitted is not None:
            steps = int(pending.emitted[col])
        for k in range(steps):
            seq.add_token(int(tokens[k, col]), float(logprobs[k, col]),
                          top_ids[k, col], top_lps[k, col])
            self.stats["tokens"] += 1
            if seq.finished:
                break
        if slot not in self.rows.prefilling:  # pages its decoding filled join the cache
            self.chunks.offer_pages(slot, seq, int(self.engine.lengths[slot]))
        if seq.finished:
            self.rows.free(slot)
            self.stats["finished"] += 1  # counted before the client can see the end
            seq.post_final()

    def _end_pooled(self, slot: int, seq: Any, vector: np.ndarray, mean: np.ndarray) -> None:
        """A pooling request's prompt is in: its row is freed and it ends with `Pooled`
        (`vector`: `[E]` float32, its last token's final-normed hidden state; `mean`: their
        mean over the prompt)."""
        seq.finished = True
        self.rows.free(slot)
        self.stats["finished"] += 1
        seq.handle.post(Pooled(np.array(vector, np.float32), seq.input_tokens,
                               seq.cached_tokens or 0, np.array(mean, np.float32)))


def _start_copy(output: Any) -> None:
    """Starts the device-to-host copy of a step output without waiting for it."""
    for name in ("tokens", "logprobs", "top_ids", "top_logprobs", "pooled", "pooled_mean"):
        arr = getattr(output, name, None)
        if hasattr(arr, "copy_to_host_async"):
            arr.copy_to_host_async()
