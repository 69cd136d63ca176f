"""The batching loop: one background thread that owns the engine and its decode state.

Threads and queues:
- Callers (HTTP handlers, the Python API) call `submit`, which validates the request, puts it
  on the bounded `waiting` queue (full -> `BusyError`) and returns a `RequestHandle`. The
  queue orders by the request's `priority` (lower first) within the tenants' fairness: FIFO
  within a tenant and round-robin across tenants among equal priorities, with an optional
  cap on the slots a tenant holds that no priority passes (scheduler/waiting.py); without
  tenants and priorities it is one FIFO.
  `cancel` puts the id on a set read by the loop. Nothing but the loop thread touches JAX.
- The loop thread, each iteration: drops cancelled and timed-out requests (their pages go
  back to the pool), admits waiting requests into free slots (rows), and launches one
  `engine.step`: every decoding row advances one token while pieces of the admitted prompts
  ride along (chunked prefill under the step's token budget, `max_prefill_len`), so a new
  prompt, however long, never stops the rows that decode. It starts copying the step's
  output to the host and only then reads the *previous* step's output (one step late), so
  the device is never idle while Python detokenizes.
- Pages (`engine.pages`): a row gets pages as its tokens need them. A prompt piece waits
  while the pool is short; a decoding row that needs a page the pool cannot give makes the
  loop preempt the most recently admitted sequence (its pages freed, its request put back at
  the head of the queue; later its prompt and the tokens generated so far are prefilled again
  and it continues where it stopped: the client sees only latency). `stats["preempted"]`
  counts them. The victim is the worst priority (highest value), then the newest. A waiting
  or prefilling request of a better priority preempts worse ones the same way when it lacks
  a row or a page (scheduler/preemption.py; `stats["preempted_by_priority"]`).
- Events go to each request's handle (`post`), which forwards them to the caller's thread or
  event loop.
Backpressure: `max_waiting` bounds the queue; the slots bound the work in flight.
Faults (`health`, scheduler/health.py): a watchdog sees a stall; a failed step fails only
its requests.

The scheduler owns its parts, each built here from the engine: request validation
(validation.py), the LoRA registry (lora_registry.py), the rows (rows.py), chunk planning
under the step budget with the prefix cache (chunks.py), the launched steps and the decode
state (steps.py), beam rows (beam_rows.py, beside the search in beam.py), speculation
(speculation.py), grammar masks (grammar_slots.py) and preemption's victims
(preemption.py). This module is the loop and the caller side: the waiting queue,
admissions, cancels, deadlines and preemption.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from metrale_jax.errors import BusyError
from metrale_jax.scheduler.beam_rows import BeamRows
from metrale_jax.scheduler.chunks import ChunkPlanner
from metrale_jax.scheduler.events import Cancelled, Failed, TimedOut
from metrale_jax.scheduler.grammar_slots import GrammarSlots
from metrale_jax.scheduler.health import LoopHealth
from metrale_jax.scheduler.lora_registry import LoraMix, LoraRegistry
from metrale_jax.scheduler.preemption import Preemption
from metrale_jax.scheduler.request import GenerationRequest, RequestHandle
from metrale_jax.scheduler.rows import Rows
from metrale_jax.scheduler.sequence import Sequence
from metrale_jax.scheduler.speculation import Speculation
from metrale_jax.scheduler.step_failures import StepFailureError
from metrale_jax.scheduler.step_time import DEFAULT_MAX_ITL_MS, StepTimes, check_target
from metrale_jax.scheduler.steps import StepRunner
from metrale_jax.scheduler.validation import RequestValidator
from metrale_jax.scheduler.waiting import WaitingQueue

WARMUP_MODES = ("serve", "full", "none")
"""How a `Scheduler` compiles before it serves (its `warmup` argument)."""

log = logging.getLogger(__name__)


class Scheduler:
    """Owns an `Engine` and runs the batching loop in a background thread.

    Args:
        engine: a `metrale_jax.engine.Engine` (compiled steps and shapes).
        tokenizer: the model's tokenizer (detokenizing, special ids).
        eos_token_ids: ids that end a request unless `ignore_eos`.
        max_waiting: bound of the waiting queue; `submit` beyond it raises `BusyError`.
        warmup: "full" (or True): compile every program before serving; "serve": compile
            the few programs that serve any request, then serve while the rest of the grid
            compiles in the background (`Engine.warmup(background=True)`); "none" (or
            False): each program compiles on first use.
        warmup_progress: `progress(done, total)` after each program compiled by warmup
            before serving (passed to `engine.warmup(progress=...)`; None passes nothing).
        loras: LoRA adapters (`weights.lora.LoraAdapter`) by name, loaded into the engine's
            slots in order before serving; a request names one in `SamplingParams.lora`.
        max_itl_ms: the latency target (ms): while rows decode, each step's prompt chunk is
            sized so that its predicted time stays within it (scheduler/step_time.py); a
            request may ask for a tighter one (`GenerationRequest.max_itl_ms`). None or 0:
            no target (chunks as large as the FLOP budget allows).
        stall_timeout, exit_on_stall: the watchdog's (`LoopHealth`, scheduler/health.py).

    Parts (built here, used by the loop thread): `validator`, `loras`, `rows`,
    `preemption`, `chunks`, `beams`, `speculation`, `steps`, `grammar`, `health`.
    """

    def __init__(self, engine, tokenizer, eos_token_ids: tuple[int, ...] = (),
                 max_waiting: int = 256, warmup: bool | str = True,
                 warmup_progress: Callable[[int, int], None] | None = None,
                 loras: dict[str, Any] | None = None,
                 max_itl_ms: float | None = DEFAULT_MAX_ITL_MS,
                 stall_timeout: float | None = None, exit_on_stall: bool = False):
        self.engine = engine
        self.tokenizer = tokenizer
        self.eos_token_ids = tuple(eos_token_ids)
        self.max_waiting = max_waiting
        self.num_slots = engine.config.max_slots
        self.max_len = engine.config.max_len
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._waiting = WaitingQueue()
        self._cancelled: set[str] = set()
        self._running = True
        self._ready = threading.Event()
        self.startup_error: BaseException | None = None  # set when warmup failed
        self._warmup = {True: "full", False: "none"}.get(warmup, warmup)  # type: ignore
        if self._warmup not in WARMUP_MODES:
            raise ValueError(f"warmup must be one of {WARMUP_MODES}, not {warmup!r}")
        self._warmup_progress = warmup_progress
        self.stats = collections.Counter()
        self.grammar = GrammarSlots(tokenizer, engine.model_config.vocab_size, self.num_slots)
        self.loras = LoraRegistry(engine, loras, self._wake, lambda: self._running)
        self.validator = RequestValidator(engine, tokenizer, self.eos_token_ids, self.grammar,
                                          self.loras)
        self.rows = Rows(engine, self.grammar, self.num_slots)
        self.preemption = Preemption(engine, self.rows)
        check_target(max_itl_ms or None, "max_itl_ms")
        # (an engine without a step cost, such as a test's stand-in, gets no target)
        self.step_times = (StepTimes(engine, max_itl_ms) if hasattr(engine, "step_cost")
                           else None)
        self.chunks = ChunkPlanner(engine, self.rows, self.stats, self.step_times)
        self.beams = BeamRows(engine, tokenizer, self.eos_token_ids, self.max_len, self.rows,
                              self.grammar, self.stats)
        self.speculation = Speculation(engine, self.rows, self.grammar, self.stats)
        self.steps = StepRunner(engine, self.rows, self.grammar, self.chunks, self.beams,
                                self.speculation, self.stats, self.step_times)
        self.health = LoopHealth(self.rows, self.preemption, self.steps, self.stats,
                                 self._lock, self._waiting, stall_timeout, exit_on_stall)
        self._thread = threading.Thread(target=self._run, name="metrale-scheduler", daemon=True)
        self._thread.start()

    # ---- caller side -------------------------------------------------------------------
    @property
    def state(self) -> Any:
        """The engine's decode state (`StepRunner.state`; the loop thread's)."""
        return self.steps.state

    @state.setter
    def state(self, state: Any) -> None:
        self.steps.state = state

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Blocks until warmup has ended; True when it succeeded and the loop is serving,
        False on a timeout or when warmup failed (`startup_error` then says why)."""
        return self._ready.wait(timeout) and self.startup_error is None

    @property
    def ready(self) -> bool:
        """True once the engine is warmed up and the loop is serving."""
        return self._ready.is_set() and self.startup_error is None

    def check(self, request: GenerationRequest) -> None:
        """Validates a request against the engine's shapes; raises a `MetraleError`."""
        self.validator.check(request)
        check_target(request.max_itl_ms)

    def submit(self, request: GenerationRequest, loop=None) -> RequestHandle:
        """Queues a request; returns its handle. Raises `BusyError` when the queue is full.

        `loop`: the asyncio loop that will `async for` over the handle (None: blocking use).
        """
        self.check(request)
        self.health.refuse_if_unhealthy()
        handle = RequestHandle(request, self.cancel, loop)
        lora, lora_key = self.loras.for_request(request.params.lora)
        seq = Sequence(request, handle, self.tokenizer, self.eos_token_ids, self.max_len,
                       lora=lora, lora_key=lora_key)
        with self._lock:
            if not self._running:
                raise BusyError("the scheduler is stopped")
            if len(self._waiting) >= self.max_waiting:
                raise BusyError(f"the waiting queue is full ({self.max_waiting} requests); "
                                "retry later")
            self._waiting.append(seq)
            self.health.submitted()
            self._wake.notify()
        return handle

    @property
    def lora_slots(self) -> dict[str, int]:
        """Name -> engine LoRA slot of every loaded adapter."""
        return self.loras.slots

    @property
    def active_lora(self) -> LoraMix:
        """What a request naming no adapter gets: (name, weight) pairs (`set_active_lora`)."""
        return self.loras.active

    def set_active_lora(self, mix: dict[str, float]) -> None:
        """Sets the adapters a request that names none is served with (llama.cpp's global
        scales, the reference design's slot -1): {name: weight}; {} for the base model.
        Requests already queued keep the adapters they were given."""
        self.loras.set_active(mix)

    def load_lora(self, name: str, adapter: Any) -> Future:
        """Loads `adapter` (a `weights.lora.LoraAdapter`) into a free slot under `name`, on
        the loop thread (nothing compiles). The future raises `InvalidParameterError` when
        the name is taken or every slot holds an adapter."""
        return self.loras.load(name, adapter)

    def unload_lora(self, name: str) -> Future:
        """Unloads adapter `name`: new requests for it are refused at once; the future ends
        when the last request using it has ended and its slot is cleared."""
        return self.loras.unload(name)

    def cancel(self, request_id: str) -> None:
        """Cancels a request from any thread; its slot is freed at the next iteration."""
        with self._lock:
            self._cancelled.add(request_id)
            self._wake.notify()

    def stop(self, timeout: float = 30.0) -> None:
        """Ends every in-flight and waiting request with a terminal event; joins the thread."""
        with self._lock:
            self._running = False
            self._wake.notify()
        self._thread.join(timeout)

    def abort(self, error: BaseException) -> None:
        """Fails every in-flight and waiting request with `error` and refuses new ones.

        Safe from any thread even while the loop thread is stuck (a multi-host peer died
        inside a collective: metrale_jax/multihost/); a loop that still runs ends at its next
        iteration. Events after a request's `Failed` are ignored by its handle.
        """
        with self._lock:
            self._running = False
            self._wake.notify()
        self._fail_all(error)

    def snapshot(self) -> dict[str, Any]:
        """Slot occupancy and queue length, for metrics and dashboards (any thread).

        slots[i]: None, or {"request_id", "tenant", "prompt_tokens", "tokens" (generated so
        far), "running_s" (since admission)} (`Rows.occupancy`). waiting_by_tenant: {tenant:
        requests waiting} (None: requests without one). stats: the loop's counters
        ("admitted", "finished", "steps", "tokens", "loop_errors"). Read without stopping
        the loop: the slot list is copied at once, and each slot's sequence is read through
        one reference.
        """
        with self._lock:
            waiting = len(self._waiting)
            by_tenant = self._waiting.by_tenant()
        return {"slots": self.rows.occupancy(time.monotonic()), "waiting": waiting,
                "waiting_by_tenant": by_tenant, "stats": dict(self.stats)}

    # ---- loop thread -------------------------------------------------------------------
    def _run(self) -> None:
        started = time.monotonic()
        try:
            if self._warmup != "none":
                options: dict[str, Any] = {}
                if self._warmup_progress is not None:
                    options["progress"] = self._warmup_progress
                if self._warmup == "serve":
                    options["background"] = True
                self.engine.warmup(**options)
            self.steps.reset_state()
            if self._warmup != "none":
                self.steps.measure()  # the step-time model's shapes (compiled programs)
            self.loras.load_initial()
        except Exception as e:  # nothing can be served: fail whatever is queued
            log.exception("engine warmup failed")
            self.startup_error = e
            with self._lock:
                self._running = False
            self._fail_all(e)
            self._ready.set()
            return
        self._ready.set()
        self.health.start(time.monotonic() - started)
        while True:
            with self._lock:
                if not self._running:
                    break
                if (not self._waiting and not self.rows.busy() and not self.steps.pending
                        and self.loras.idle):
                    with self.health.idle():  # waiting for work counts as progress
                        self._wake.wait(timeout=1.0)
                cancelled, self._cancelled = self._cancelled, set()
            try:
                self._drop(cancelled)
                self.loras.run_ops(self._lora_users)
                self._admit()
                launched = False
                if self.rows.busy():
                    if not self.rows.prefilling and (
                            self.grammar.must_drain(self.rows.decoding())
                            or self.speculation.speculating()):
                        self.steps.drain()  # nothing to overlap with (drafts need the tokens)
                    launched = self.steps.launch(self._preempt)
                # Read outputs one step late: keep the newest in flight while a step was
                # launched (rows waiting on a step's output, as beams do, get it now).
                self.steps.read(keep=1 if launched else 0)
            except StepFailureError as failure:  # its requests fail, the others go back
                self.health.step_failed(failure, self._fail_all)
            except Exception as e:
                log.exception("batching loop iteration failed")
                self.stats["loop_errors"] += 1
                self.steps.clear()
                self._fail_slots(e)
                try:
                    self.steps.reset_state()
                except Exception:
                    log.exception("could not rebuild the decode state")
        self.health.watchdog.stop()
        self._shutdown()

    def _lora_users(self) -> list[Sequence]:
        """The queued and running sequences (an unloaded adapter waits for them)."""
        with self._lock:
            waiting = list(self._waiting)
        return waiting + [s for s in self.rows.seqs if s is not None]

    def _drop(self, cancelled: set[str]) -> None:
        """Ends the cancelled requests and those past their deadline, running or waiting."""
        now = time.monotonic()

        def gone(seq: Sequence) -> bool:
            return seq.request.request_id in cancelled or (
                seq.request.deadline is not None and now > seq.request.deadline)

        def event(seq: Sequence) -> Cancelled | TimedOut:
            if seq.request.request_id in cancelled:
                return Cancelled(seq.prompt_len, seq.num_generated)
            return TimedOut(seq.prompt_len, seq.num_generated)

        self.rows.end_where(gone, event)
        with self._lock:
            dropped = self._waiting.remove_where(gone)
        for seq in dropped:
            self.preemption.forget(seq.request.request_id)
            seq.handle.post(event(seq))

    def _admit(self) -> None:
        """Moves waiting requests into free slots (lowest first): by priority within the
        tenants' fairness (scheduler/waiting.py); their prompts are then prefilled piece by
        piece along the next steps. A beam search takes its W rows at once. Then, while a
        waiting request of a better priority cannot go for want of rows, or an admitted one
        of a better priority cannot prefill for want of pages, it preempts worse ones
        (`_preempt_for_priority`) and admits again."""
        for _ in range(2 * self.num_slots + 2):  # each round frees a worse sequence
            self._admit_free()
            if not self._preempt_for_priority():
                return

    def _admit_free(self) -> None:
        """One admission round into the free slots."""
        free = self.rows.free_slots()
        if not free:
            return
        held = self._held()
        with self._lock:
            admitted: list[tuple[list[int], Sequence]] = []
            while free and self._waiting:
                # (a beam search takes its rows at once: `take` waits for them)
                seq = self._waiting.take(len(free), held.__getitem__, self.preemption.yields)
                if seq is None:
                    break
                width = seq.request.params.num_beams
                held[seq.request.tenant] += width
                admitted.append((free[:width], seq))
                del free[:width]
        now = time.monotonic()
        for slots, seq in admitted:
            self.rows.place(slots[0], seq, now)
            if len(slots) > 1:
                self.beams.start(seq, slots)
        self.stats["admitted"] += sum(1 for _, s in admitted if not s.token_ids)

    def _held(self) -> collections.Counter:
        """{tenant: rows its sequences hold}."""
        return collections.Counter(s.request.tenant for s in self.rows.seqs if s is not None)

    def _preempt_for_priority(self) -> bool:
        """Preemption by priority (scheduler/preemption.py): the planned victims' rows are
        freed and their requests go back to the queue; True when something was freed (or
        the steps in flight were read first): the caller admits again."""
        with self._lock:
            head = self._waiting.peek(self._held().__getitem__, self.preemption.yields)
        beneficiary, victims = self.preemption.plan(head)
        if not victims:
            return False
        if self.steps.pending:  # a victim's tokens must be known: read them first
            self.steps.drain()
            return True
        for slot, seq in victims:
            seq = self.preemption.free_rows(slot, seq)
            self.preemption.made_room_for[seq.request.request_id] = beneficiary
            self.stats["preempted_by_priority"] += 1
            with self._lock:
                self._waiting.appendleft(seq)
        return True

    def _preempt(self) -> bool:
        """The KV pool's preemption: frees the worst-priority, then most recently admitted,
        sequence's rows and puts its request back at the head of the queue (recomputed
        later); a sequence alone that outgrew the pool ends with finish_reason "length".
        False when nothing could be freed."""
        running = self.preemption.by_worst()
        if not running:
            return False
        _, _, slot, seq = running[0]
        if len(running) == 1:  # nothing else holds pages: the pool can't hold this sequence
            rows = seq.beam.rows if seq.beam is not None else [slot]
            seq = seq.beam.primary if seq.beam is not None else seq
            seq.end_for_length()
            for row in rows:
                self.rows.free(row)
            seq.post_final()
            return True
        seq = self.preemption.free_rows(slot, seq)
        self.stats["preempted"] += 1
        with self._lock:
            self._waiting.appendleft(seq)
        return True

    def _fail_slots(self, error: BaseException) -> None:
        self.rows.end_each(lambda seq: Failed(error))

    def _fail_all(self, error: BaseException) -> None:
        self._fail_slots(error)
        with self._lock:
            waiting = self._waiting.clear()
        for seq in waiting:
            seq.handle.post(Failed(error))

    def _shutdown(self) -> None:
        def shutdown(seq: Sequence) -> Cancelled:
            return Cancelled(seq.prompt_len, seq.num_generated, "shutdown")
        self.rows.end_each(shutdown)
        with self._lock:
            waiting = self._waiting.clear()
        for seq in waiting:
            seq.handle.post(shutdown(seq))
