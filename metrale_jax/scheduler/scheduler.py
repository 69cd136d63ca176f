"""The batching loop: one background thread that owns the engine and its decode state.

Threads and queues:
- Callers (HTTP handlers, the Python API) call `submit`, which validates the request, puts it
  on the bounded `waiting` queue (full -> `BusyError`) and returns a `RequestHandle`. The
  queue is FIFO within a tenant and round-robin across tenants, with an optional cap on the
  slots a tenant holds (scheduler/waiting.py); without tenants it is one FIFO.
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
  counts them.
- Events go to each request's handle (`post`), which forwards them to the caller's thread or
  event loop.
Backpressure: `max_waiting` bounds the queue; the slots bound the work in flight.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import random
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import numpy as np

from metrale_jax.engine import Piece
from metrale_jax.engine.images import find_image_offsets, remaining_images
from metrale_jax.engine.sampling_state import MAX_BAD_WORD_TOKENS, MAX_BAD_WORDS
from metrale_jax.errors import BusyError, ContextLengthError, InvalidParameterError
from metrale_jax.scheduler.beam import BeamSearch
from metrale_jax.scheduler.events import (
    BeamHypothesis,
    Cancelled,
    Failed,
    Finished,
    TimedOut,
    Token,
)
from metrale_jax.scheduler.grammar_slots import GrammarSlots
from metrale_jax.scheduler.request import GenerationRequest, RequestHandle
from metrale_jax.scheduler.sequence import Sequence
from metrale_jax.scheduler.speculation import Pending, SpeculativeDecoding
from metrale_jax.scheduler.token_sets import bad_word_ids
from metrale_jax.scheduler.waiting import WaitingQueue

log = logging.getLogger(__name__)


class Scheduler(SpeculativeDecoding):
    """Owns an `Engine` and runs the batching loop in a background thread.

    Args:
        engine: a `metrale_jax.engine.Engine` (compiled steps and shapes).
        tokenizer: the model's tokenizer (detokenizing, special ids).
        eos_token_ids: ids that end a request unless `ignore_eos`.
        max_waiting: bound of the waiting queue; `submit` beyond it raises `BusyError`.
        warmup: compile every program before serving.
        warmup_progress: `progress(done, total)` after each program compiled by warmup
            (passed to `engine.warmup(progress=...)`; None passes nothing).
        loras: LoRA adapters (`weights.lora.LoraAdapter`) by name, loaded into the engine's
            slots in order before serving; a request names one in `SamplingParams.lora`.
    """

    def __init__(self, engine, tokenizer, eos_token_ids: tuple[int, ...] = (),
                 max_waiting: int = 256, warmup: bool = True,
                 warmup_progress: Callable[[int, int], None] | None = None,
                 loras: dict[str, Any] | None = None):
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
        self._slots: list[Sequence | None] = [None] * self.num_slots
        # Beam rows to set and pages to copy before the next step (`_flush_beams`).
        self._beam_sets: list[tuple[int, int, int]] = []
        self._beam_copies: list[tuple[int, int]] = []
        self._prefilling: list[int] = []  # slots whose prompt is being prefilled, in order
        self._running = True
        self._ready = threading.Event()
        self.startup_error: BaseException | None = None  # set when warmup failed
        self._warmup = warmup
        self._warmup_progress = warmup_progress
        # slot -> (request id, time.monotonic() at admission); written by the loop thread only,
        # read by `snapshot` (a dict item assignment is atomic).
        self._admitted_at: dict[int, tuple[str, float]] = {}
        self.stats = collections.Counter()
        self.grammar = GrammarSlots(tokenizer, engine.model_config.vocab_size, self.num_slots)
        loras = dict(loras or {})
        if loras and len(loras) > engine.config.max_loras:
            raise InvalidParameterError(
                f"{len(loras)} LoRA adapters for {engine.config.max_loras} slots (max_loras)",
                param="loras")
        self._lora_adapters = loras
        self.lora_slots = {name: i for i, name in enumerate(loras)}  # name -> engine slot
        # Each loaded adapter's prefix-cache key: its name and which load it is, so pages of
        # an adapter unloaded and loaded again under the same name are never reused.
        self._lora_loads = itertools.count()
        self.lora_keys = {name: f"{name}#{next(self._lora_loads)}" for name in loras}
        self._unloading: dict[str, Future] = {}  # name -> the caller's future
        # What a request naming no adapter gets: (name, weight) pairs (set_active_lora).
        self.active_lora: tuple[tuple[str, float], ...] = ()
        self._lora_ops: collections.deque[tuple[Callable[[], Any], Future]] = \
            collections.deque()
        self._thread = threading.Thread(target=self._run, name="metrale-scheduler", daemon=True)
        self._thread.start()

    # ---- caller side -------------------------------------------------------------------
    def wait_ready(self, timeout: float | None = None) -> bool:
        """Blocks until warmup has ended; True when it succeeded and the loop is serving,
        False on a timeout or when warmup failed (`startup_error` then says why)."""
        return self._ready.wait(timeout) and self.startup_error is None

    @property
    def ready(self) -> bool:
        """True once the engine is warmed up and the loop is serving."""
        return self._ready.is_set() and self.startup_error is None

    def _check_images(self, request: GenerationRequest) -> None:
        """A request's images match its prompt's placeholder runs (raises otherwise)."""
        engine = self.engine
        engine.check_images(len(request.images))
        vision = engine.model_config.vision
        if vision is None:
            return
        T = vision.tokens_per_image
        offsets = find_image_offsets(request.prompt_ids, vision.image_token_id, T)
        if len(offsets) != len(request.images):
            raise InvalidParameterError(
                f"the prompt has {len(offsets)} image placeholders for {len(request.images)} "
                "images", param="messages")
        shape = (vision.num_channels, vision.image_size, vision.image_size)
        for at, im in zip(offsets, request.images, strict=True):
            if im.offset != at or im.length != T or tuple(im.pixels.shape) != shape:
                raise InvalidParameterError(
                    f"an image at prompt position {im.offset} does not fit this model "
                    f"({T} placeholders at {at}, pixels {shape})", param="messages")

    def check(self, request: GenerationRequest) -> None:
        """Validates a request against the engine's shapes; raises a `MetraleError`."""
        n = len(request.prompt_ids)
        if n == 0:
            raise InvalidParameterError("the prompt must not be empty", param="prompt")
        if self.engine.encoder_decoder:
            if not request.source:
                raise InvalidParameterError("a translation model needs the text to translate",
                                            param="messages")
            self.engine.check_source(len(request.source))
            vocab = self.engine.model_config.vocab_size
            if min(request.source) < 0 or max(request.source) >= vocab:
                raise InvalidParameterError(f"source token ids must be in [0, {vocab})",
                                            param="prompt")
        elif request.source:
            raise InvalidParameterError("a source (text to translate) is for translation "
                                        "models; this model is decoder-only", param="source")
        self._check_images(request)
        vocab = self.engine.model_config.vocab_size
        if min(request.prompt_ids) < 0 or max(request.prompt_ids) >= vocab:
            raise InvalidParameterError(f"prompt token ids must be in [0, {vocab})",
                                        param="prompt")
        if any(t >= vocab for t in request.params.stop_token_ids):
            raise InvalidParameterError(f"stop_token_ids must be < {vocab}",
                                        param="stop_token_ids")
        if any(t >= vocab for t, _ in request.params.logit_bias):
            raise InvalidParameterError(
                f"logit_bias has a token id outside the vocabulary [0, {vocab})",
                param="logit_bias")
        if request.params.bad_words:  # resolves now, so a bad word is a 400 here
            _, words = bad_word_ids(self.tokenizer, request.params.bad_words)
            if len(words) > MAX_BAD_WORDS or any(len(w) > MAX_BAD_WORD_TOKENS for w in words):
                raise InvalidParameterError(
                    f"bad_words: at most {MAX_BAD_WORDS} multi-token sequences of at most "
                    f"{MAX_BAD_WORD_TOKENS} tokens each", param="bad_words")
        if request.params.constraint is not None:
            self.grammar.validate(request.params.constraint, self.engine.config.decode_steps)
        self._lora_mix(request.params.lora)
        self._check_beams(request)
        most = self.engine.config.speculative_tokens
        if (request.params.speculative_tokens or 0) > most:
            raise InvalidParameterError(
                f"speculative num_tokens must be at most {most} here (the server's "
                "--speculative-tokens)", param="speculative")
        wanted = request.params.max_tokens or 1
        if n + wanted > self.max_len:
            raise ContextLengthError(
                f"this model's maximum context length is {self.max_len} tokens, but the "
                f"request has {n} prompt tokens plus max_tokens={wanted} "
                f"({n + wanted} in all)")
        pages = self.engine.pages
        if pages.pages_for(n + wanted) > pages.usable_pages:
            raise ContextLengthError(
                f"the KV cache holds {pages.usable_pages * pages.page_size} tokens in all, but "
                f"the request has {n} prompt tokens plus max_tokens={wanted} "
                f"({n + wanted} in all)")

    def _check_beams(self, request: GenerationRequest) -> None:
        p = request.params
        if p.num_beams == 1:
            return
        cfg = self.engine.config
        eos = 0 if p.ignore_eos else len(set(self.eos_token_ids) | set(p.stop_token_ids))
        top = cfg.num_top_logprobs
        most = min(self.num_slots, (top - eos) // max(2, 1 + eos))
        if p.num_beams > most:
            raise InvalidParameterError(
                f"num_beams must be at most {most} here ({self.num_slots} sequence slots, "
                f"{top} top log-probabilities per step)", param="num_beams")
        if cfg.decode_steps != 1:
            raise InvalidParameterError("beam search needs an engine with decode_steps 1",
                                        param="num_beams")
        if cfg.logprobs_mode != "raw":
            raise InvalidParameterError("beam search needs the server's logprobs mode 'raw'",
                                        param="num_beams")

    def submit(self, request: GenerationRequest, loop=None) -> RequestHandle:
        """Queues a request; returns its handle. Raises `BusyError` when the queue is full.

        `loop`: the asyncio loop that will `async for` over the handle (None: blocking use).
        """
        self.check(request)
        handle = RequestHandle(request, self.cancel, loop)
        mix = self._lora_mix(request.params.lora)
        seq = Sequence(request, handle, self.tokenizer, self.eos_token_ids, self.max_len,
                       lora=tuple((self.lora_slots[name], w) for name, w in mix),
                       lora_key=",".join(f"{self.lora_keys[name]}*{w!r}" for name, w in mix)
                       or None)
        with self._lock:
            if not self._running:
                raise BusyError("the scheduler is stopped")
            if len(self._waiting) >= self.max_waiting:
                raise BusyError(f"the waiting queue is full ({self.max_waiting} requests); "
                                "retry later")
            self._waiting.append(seq)
            self._wake.notify()
        return handle

    def _lora_mix(self, lora: tuple[tuple[str, float], ...] | None
                  ) -> tuple[tuple[str, float], ...]:
        """A request's adapters, (name, weight) pairs without zero weights: its own choice, or
        the active mix when it made none (None). Raises when one is not loaded."""
        mix = self.active_lora if lora is None else lora
        for name, _ in mix:
            if name not in self.lora_slots or name in self._unloading:
                known = ", ".join(sorted(set(self.lora_slots) - set(self._unloading))) or "none"
                why = "is being unloaded" if name in self._unloading else "is not loaded"
                raise InvalidParameterError(
                    f"the LoRA adapter {name!r} {why} (loaded: {known})", param="lora")
        return tuple((name, float(w)) for name, w in mix if w != 0)

    def set_active_lora(self, mix: dict[str, float]) -> None:
        """Sets the adapters a request that names none is served with (llama.cpp's global
        scales, the reference design's slot -1): {name: weight}; {} for the base model.
        Requests already queued keep the adapters they were given."""
        with self._lock:
            self.active_lora = self._lora_mix(tuple(mix.items()))

    def load_lora(self, name: str, adapter: Any) -> Future:
        """Loads `adapter` (a `weights.lora.LoraAdapter`) into a free slot under `name`, on
        the loop thread (nothing compiles). The future raises `InvalidParameterError` when
        the name is taken or every slot holds an adapter."""
        return self._lora_op(lambda: self._load_lora(name, adapter))

    def unload_lora(self, name: str) -> Future:
        """Unloads adapter `name`: new requests for it are refused at once; the future ends
        when the last request using it has ended and its slot is cleared."""
        future: Future = Future()
        with self._lock:
            if name not in self.lora_slots or name in self._unloading:
                future.set_exception(InvalidParameterError(
                    f"no LoRA adapter {name!r} is loaded", param="lora_name"))
            else:
                self._unloading[name] = future  # from now on `check` refuses it
                self.active_lora = tuple((n, w) for n, w in self.active_lora if n != name)
                self._wake.notify()
        return future

    def _lora_op(self, fn: Callable[[], Any]) -> Future:
        future: Future = Future()
        with self._lock:
            if not self._running:
                raise BusyError("the scheduler is stopped")
            self._lora_ops.append((fn, future))
            self._wake.notify()
        return future

    def _run_lora_ops(self) -> None:
        """Runs queued adapter loads and unloads; clears unloaded adapters no one uses."""
        while self._lora_ops:
            fn, future = self._lora_ops.popleft()
            try:
                future.set_result(fn())
            except Exception as e:
                future.set_exception(e)
        for name, future in list(self._unloading.items()):
            slot = self.lora_slots[name]
            with self._lock:
                waiting = [s for s in self._waiting if _uses(s, slot)]
            if waiting or any(s is not None and _uses(s, slot) for s in self._slots):
                continue
            self.engine.set_lora(slot, None)
            del self.lora_slots[name], self.lora_keys[name], self._unloading[name]
            future.set_result(None)

    def _load_lora(self, name: str, adapter: Any) -> int:
        if name in self.lora_slots:
            raise InvalidParameterError(f"a LoRA adapter named {name!r} is already loaded",
                                        param="lora_name")
        used = set(self.lora_slots.values())
        free = [i for i in range(self.engine.config.max_loras) if i not in used]
        if not free:
            raise InvalidParameterError(
                f"all {self.engine.config.max_loras} LoRA slots hold adapters (--max-loras); "
                "unload one first", param="lora_name")
        self.engine.set_lora(free[0], adapter)
        self.lora_keys[name] = f"{name}#{next(self._lora_loads)}"
        self.lora_slots[name] = free[0]
        return free[0]

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
        inside a collective: scheduler/multihost.py); a loop that still runs ends at its next
        iteration. Events after a request's `Failed` are ignored by its handle.
        """
        with self._lock:
            self._running = False
            self._wake.notify()
        self._fail_all(error)

    def snapshot(self) -> dict[str, Any]:
        """Slot occupancy and queue length, for metrics and dashboards (any thread).

        slots[i]: None, or {"request_id", "tenant", "prompt_tokens", "tokens" (generated so
        far), "running_s" (since admission)}. waiting_by_tenant: {tenant: requests waiting}
        (None: requests without one). stats: the loop's counters ("admitted", "finished",
        "steps", "tokens", "loop_errors"). Read without stopping the loop: the slot list is
        copied at once, and each slot's sequence is read through one reference. A finished
        sequence's slot reads as free: its last event is posted before the loop frees the
        row, and a client that saw its request end must not see it running.
        """
        with self._lock:
            waiting = len(self._waiting)
            by_tenant = self._waiting.by_tenant()
        now = time.monotonic()
        admitted = dict(self._admitted_at)
        slots: list[dict[str, Any] | None] = []
        for i, seq in enumerate(list(self._slots)):
            if seq is None or seq.finished:
                slots.append(None)
                continue
            rid = seq.request.request_id
            since = admitted.get(i)
            slots.append({"request_id": rid, "tenant": seq.request.tenant,
                          "prompt_tokens": seq.prompt_len, "tokens": seq.num_generated,
                          "running_s": now - since[1] if since and since[0] == rid else None})
        return {"slots": slots, "waiting": waiting, "waiting_by_tenant": by_tenant,
                "stats": dict(self.stats)}

    # ---- loop thread -------------------------------------------------------------------
    def _run(self) -> None:
        try:
            if self._warmup and self._warmup_progress is not None:
                self.engine.warmup(progress=self._warmup_progress)
            elif self._warmup:
                self.engine.warmup()
            self.state = self.engine.init_decode_state()
            for name, adapter in self._lora_adapters.items():
                self.engine.set_lora(self.lora_slots[name], adapter)
        except Exception as e:  # nothing can be served: fail whatever is queued
            log.exception("engine warmup failed")
            self.startup_error = e
            with self._lock:
                self._running = False
            self._fail_all(e)
            self._ready.set()
            return
        self._ready.set()
        pending: collections.deque[Pending] = collections.deque()
        while True:
            with self._lock:
                if not self._running:
                    break
                if (not self._waiting and not any(self._slots) and not pending
                        and not self._lora_ops and not self._unloading):
                    self._wake.wait(timeout=1.0)
                cancelled, self._cancelled = self._cancelled, set()
            try:
                self._drop(cancelled)
                self._run_lora_ops()
                self._admit()
                step = None
                if any(self._slots):
                    if not self._prefilling and (self.grammar.must_drain(self._decoding())
                                                 or self._speculating()):
                        while pending:  # nothing to overlap with (drafts need the tokens)
                            self._consume(pending.popleft())
                    step = self._launch_step(pending)
                    if step is not None:
                        pending.append(step)
                # Read outputs one step late: keep the newest in flight while a step was
                # launched (rows waiting on a step's output, as beams do, get it now).
                keep = 1 if step is not None else 0
                while len(pending) > keep:
                    self._consume(pending.popleft())
            except Exception as e:
                log.exception("batching loop iteration failed")
                self.stats["loop_errors"] += 1
                pending.clear()
                self._beam_sets, self._beam_copies = [], []
                self._fail_slots(e)
                try:
                    self.state = self.engine.init_decode_state()
                except Exception:
                    log.exception("could not rebuild the decode state")
        self._shutdown()

    def _decoding(self) -> list[Sequence | None]:
        """The slots' sequences that decode (None for free rows, rows still prefilling and
        beam rows waiting for their search's next step)."""
        return [s if s is not None and s.fed >= len(s.feed)
                and (s.beam is None or s.beam.ready) else None for s in self._slots]

    def _free_slot(self, slot: int) -> None:
        """Slot `slot` loses its sequence: its pages go back to the pool."""
        seq = self._slots[slot]
        self._slots[slot] = None
        if seq is not None and slot in self._prefilling:
            self._prefilling.remove(slot)
        self.engine.release(slot)
        self.grammar.freed(slot)

    def _drop(self, cancelled: set[str]) -> None:
        now = time.monotonic()
        for i, seq in enumerate(self._slots):
            if seq is None:
                continue
            # The row is freed before the last event goes out: a client that saw its request
            # end sees its slot free.
            if seq.request.request_id in cancelled:
                self._free_slot(i)
                seq.handle.post(Cancelled(seq.prompt_len, seq.num_generated))
            elif seq.request.deadline is not None and now > seq.request.deadline:
                self._free_slot(i)
                seq.handle.post(TimedOut(seq.prompt_len, seq.num_generated))
        with self._lock:
            gone = self._waiting.remove_where(
                lambda seq: seq.request.request_id in cancelled
                or (seq.request.deadline is not None and now > seq.request.deadline))
        for seq in gone:
            if seq.request.request_id in cancelled:
                seq.handle.post(Cancelled(seq.prompt_len, seq.num_generated))
            else:
                seq.handle.post(TimedOut(seq.prompt_len, seq.num_generated))

    def _admit(self) -> None:
        """Moves waiting requests into free slots (lowest first), round-robin across tenants
        (scheduler/waiting.py); their prompts are then prefilled piece by piece along the next
        steps."""
        free = [i for i, s in enumerate(self._slots) if s is None]
        if not free:
            return
        held = collections.Counter(s.request.tenant for s in self._slots if s is not None)
        with self._lock:
            admitted = []
            while free and self._waiting:
                # (a beam search takes its rows at once: `take` waits for them)
                seq = self._waiting.take(len(free), held.__getitem__)
                if seq is None:
                    break
                width = seq.request.params.num_beams
                held[seq.request.tenant] += width
                admitted.append((free.pop(0), seq))
                if width > 1:
                    seq.beam = _BeamGroup(seq, [admitted[-1][0], *free[:width - 1]])
                    del free[:width - 1]
        now = time.monotonic()
        for slot, seq in admitted:
            if seq.settings is None:  # first admission (a preempted one keeps its own)
                seed = seq.request.params.seed
                if seed is None:
                    seed = random.getrandbits(31)
                first_mask = None
                if seq.request.params.constraint is not None:
                    seq.matcher, first_mask = self.grammar.start(seq.request.params.constraint)
                seq.settings = seq.slot_settings(seed, first_mask)
            elif seq.matcher is not None:  # resumed: the grammar's mask where it stopped
                seq.settings = dataclasses.replace(seq.settings,
                                                   first_mask=self.grammar.mask_of(seq.matcher))
            seq.feed = list(seq.request.prompt_ids) + list(seq.token_ids)
            seq.fed = 0
            seq.keyed = 0
            seq.seeded = False
            self._slots[slot] = seq
            self._prefilling.append(slot)
            self._admitted_at[slot] = (seq.request.request_id, now)
            if seq.handle.admitted_at is None:
                seq.handle.admitted_at = now
            self.grammar.freed(slot)
            if seq.beam is not None:
                self._start_beams(seq)
        self.stats["admitted"] += sum(1 for _, s in admitted if not s.token_ids)

    def _share_prefix(self, slot: int, seq: Sequence, decode_need: int) -> None:
        """Row `slot`, before its first piece, shares the cached pages that continue its
        prefix (whole pages, leaving at least the prompt's last token to compute: its logits
        give the first token); `decode_need` pages stay for the decoding rows."""
        pages = self.engine.pages
        if pages.cache is None or seq.seeded:
            return
        ps = pages.page_size
        have = int(pages.owned[slot])
        limit = (len(seq.feed) - 1) // ps
        if seq.fed != have * ps or have >= limit:
            return
        keys = seq.keys_for(limit, ps)[have:]
        got = self.engine.reuse_prefix(slot, keys, pages.free_pages - decode_need)
        seq.fed += got * ps
        seq.keyed = have + got

    def _offer_pages(self, slot: int, seq: Sequence, written: int) -> None:
        """Offers the prefix cache row `slot`'s full pages whose `written` first positions
        are (or are being) written and whose tokens are known."""
        pages = self.engine.pages
        if pages.cache is None:
            return
        ps = pages.page_size
        full = min(written, seq.prompt_len + len(seq.token_ids), int(pages.owned[slot]) * ps)
        full //= ps
        if full > seq.keyed:
            keys = seq.keys_for(full, ps)
            self.engine.cache_pages(slot, seq.keyed, keys[seq.keyed:full])
            seq.keyed = full

    def _pieces(self, decode_need: int) -> list[tuple[Piece, Sequence]]:
        """The prompt pieces of the next step, in admission order: filling the largest chunk
        bucket that the waiting prompt tokens cover (the last piece cut to fit), the pieces
        after a context (a prompt's later piece, or one after a shared prefix) cut so that
        their cost together stays within `engine.step_cost.budget` (fresh prompts fill what
        they leave: the chunk's bucket is computed anyway), at most `max_prefill_batch`
        finishing, and leaving
        `decode_need` pages for the decoding rows. A row's first piece starts after the
        prefix it shares from the prefix cache (pages cached by earlier steps, or written by
        an earlier piece of this same step: the choices of one prompt prefill it once).
        Pages are reserved, and full ones offered to the cache, as pieces are chosen."""
        cfg, pages, cost = self.engine.config, self.engine.pages, self.engine.step_cost
        for slot in self._prefilling:
            self._share_prefix(slot, self._slots[slot], decode_need)
        # The chunk fills the largest bucket the waiting prompt tokens cover, the last piece
        # cut to fit (the rest rides along the next step): a step computes no padding but
        # when the prompts left are shorter than the smallest bucket.
        left = []
        for slot in self._prefilling:
            seq = self._slots[slot]
            rest = len(seq.feed) - seq.fed
            left.append(cost.piece_limit(rest, seq.fed, cost.budget) or cfg.chunk_buckets[0])
        filled = [c for c in cfg.chunk_buckets if c <= sum(left)]
        target = filled[-1] if filled else cfg.chunk_buckets[0]
        out: list[tuple[Piece, Sequence]] = []
        used = finishing = 0
        flops_left = cost.budget
        image_slots = self.engine.images.free_slots if self.engine.images is not None else 0
        for slot in self._prefilling:
            seq = self._slots[slot]
            self._share_prefix(slot, seq, decode_need)  # what earlier pieces just offered
            start = seq.fed
            rest = len(seq.feed) - start
            size = min(rest, target - used)
            if start:  # attention to its context: the dearer the longer that is
                size = min(size, cost.piece_limit(rest, start, flops_left))
            if not out:  # the step always makes progress
                size = max(size, min(rest, cfg.chunk_buckets[0]))
            end = start + size
            last = end == len(seq.feed)
            images = ()
            new_images = 0
            if seq.request.images:
                # Every image still ahead of the row is encoded with its first piece: a row
                # holds all its remaining images or none, so a row that holds some never
                # waits for slots (no two rows can each hold part of what the other needs).
                T = self.engine.model_config.vision.tokens_per_image
                images = remaining_images(seq.request.images, start, T)
                new_images = len(self.engine.images.missing(slot, images))
            if (size <= 0 or used + size > cfg.max_prefill_len
                    or (last and finishing >= cfg.max_prefill_batch)
                    or pages.shortfall(slot, end) > pages.free_pages - decode_need):
                break
            if new_images > image_slots:  # it waits for slots; rows after it take no new
                image_slots = 0           # ones meanwhile (its turn comes first)
                continue
            image_slots -= new_images
            settings = None
            if last:
                settings = seq.settings
                if seq.token_ids:  # resumed: what was generated before counts as generated
                    settings = dataclasses.replace(settings, generated=len(seq.token_ids))
            first_generated = seq.prompt_len if seq.token_ids else 0
            prefix = ()
            if not seq.seeded:
                seq.seeded = True
                prefix = tuple(seq.feed[:start])
                if seq.cached_tokens is None:  # a new request (not one resumed)
                    seq.cached_tokens = min(start, seq.prompt_len)
                    if pages.cache is not None:
                        self.stats["prefix_cache_queries"] += seq.prompt_len
                        self.stats["prefix_cache_hits"] += seq.cached_tokens
            self.engine.reserve(slot, end)
            source = seq.request.source if start == 0 else ()
            out.append((Piece(slot, tuple(seq.feed[start:end]), start, settings,
                              first_generated, prefix, seq.lora, source, images), seq))
            used += size
            if start:
                flops_left -= cost.piece_flops(size, start)
            finishing += last
            seq.fed = end
            self._offer_pages(slot, seq, end)
        return out

    def _launch_step(self, pending: collections.deque) -> Pending | None:
        """Launches one ragged step: decoding rows plus prompt pieces (None: nothing can
        run). Preempts when a decoding row needs a page the pool cannot give."""
        B = self.num_slots
        engine = self.engine
        while True:
            active, allowed = self.grammar.step_inputs(self._decoding())
            k = 1 if self._prefilling else engine.config.decode_steps
            need = sum(engine.pages.shortfall(int(b), int(engine.lengths[b]) + k)
                       for b in np.flatnonzero(active))
            if need <= engine.pages.free_pages:
                break
            if pending:  # read every launched step first: a victim's tokens must be known
                while pending:
                    self._consume(pending.popleft())
                continue
            if not self._preempt():
                return None
        pieces = self._pieces(need) if self._prefilling else []
        if not active.any() and not pieces:
            return None
        if not pieces and not pending:
            drafts = self._drafts(active)
            if drafts is not None:
                return self._launch_verify(active, allowed, drafts)
        self.state, out = engine.step(self.state, active, allowed, [p for p, _ in pieces])
        _start_copy(out)
        self.stats["steps"] += 1
        owners = [(int(i), int(i), self._slots[i]) for i in np.flatnonzero(active)]
        for _, _, seq in owners:
            if seq.beam is not None:  # it waits for this step's top tokens
                seq.beam.ready = False
        r = 0
        for piece, seq in pieces:
            if piece.settings is not None:
                owners.append((B + r, piece.slot, seq))
                self._prefilling.remove(piece.slot)
                r += 1
        launched = [slot for _, slot, _ in owners]
        self.grammar.launched(np.array(launched, np.int64))
        return Pending(out, owners)

    def _preempt(self) -> bool:
        """Frees the most recently admitted sequence's row and puts its request back at the
        head of the queue (recomputed later); a sequence alone that outgrew the pool ends
        with finish_reason "length". False when nothing could be freed."""
        order = sorted((at, slot) for slot, (rid, at) in self._admitted_at.items()
                       if self._slots[slot] is not None
                       and self._slots[slot].request.request_id == rid)
        if not order:
            return False
        _, slot = order[-1]
        seq = self._slots[slot]
        rows = seq.beam.rows if seq.beam is not None else [slot]
        if len(order) == 1:  # nothing else holds pages: the pool can't hold this sequence
            seq.end_for_length()
            for row in rows:
                self._free_slot(row)
            seq.post_final()
            return True
        for row in rows:  # a beam search starts again from its prompt
            self._free_slot(row)
        seq.beam = None
        self.stats["preempted"] += 1
        with self._lock:
            self._waiting.appendleft(seq)
        return True

    # ---- beam search ---------------------------------------------------------------------
    def _start_beams(self, seq: Sequence) -> None:
        """A beam request was admitted into `seq.beam.rows`: its first row prefills the
        prompt; the others wait, empty, for the first step's fork."""
        p, group = seq.request.params, seq.beam
        eos = frozenset(() if p.ignore_eos else self.eos_token_ids) | set(p.stop_token_ids)
        # A translation's target language token is forced, and transformers counts it as
        # generated (lengths are counted after the decoder start token).
        counted = seq.prompt_len - 1 if seq.request.source else 0
        group.search = BeamSearch(p.num_beams, min(p.max_tokens or self.max_len,
                                                   self.max_len - seq.prompt_len),
                                  eos, p.min_tokens, p.length_penalty, p.early_stopping,
                                  length_offset=counted)
        for i, slot in enumerate(group.rows[1:], 1):
            helper = Sequence(seq.request, _NO_EVENTS, self.tokenizer, self.eos_token_ids,
                              self.max_len, lora=seq.lora)
            helper.beam, helper.beam_index = group, i
            helper.settings, helper.seeded = seq.settings, True
            self._slots[slot] = helper
            self.grammar.freed(slot)

    def _beam_output(self, seq: Sequence, top_ids: np.ndarray, top_lps: np.ndarray) -> None:
        """One beam row's next-token top list; once every running beam has one, a search
        step: the beams fork (their rows share their parents' pages) and are fed again, or
        the search ends."""
        group = seq.beam
        group.tops[seq.beam_index] = (top_ids, top_lps)
        search = group.search
        first = search.generated == 0
        if len(group.tops) < (1 if first else search.width):
            return
        tops = [group.tops[0]] * search.width if first else \
            [group.tops[i] for i in range(search.width)]
        group.tops = {}
        parents = search.step(np.stack([t[0] for t in tops]), np.stack([t[1] for t in tops]))
        if search.done:
            self._finish_beams(group)
            return
        prompt = list(group.primary.request.prompt_ids)
        rows, claimed = group.rows, set()
        new_rows: list[int | None] = [None] * search.width
        for c, (parent, _) in enumerate(parents):  # a parent's first child keeps its row
            if parent not in claimed:
                claimed.add(parent)
                new_rows[c] = rows[parent]
        spare = [rows[i] for i in range(search.width) if i not in claimed]
        # The parents' rows hold positions < `written`; each new beam feeds its last token
        # there. A beam on another row forks: it shares the parent's full pages and copies
        # its partly written last one.
        written = len(prompt) + search.generated - 1
        moves = []
        for c, (parent, _) in enumerate(parents):
            if new_rows[c] is None:
                new_rows[c] = spare.pop()
                moves.append((new_rows[c], rows[parent], written))
        copies = self.engine.fork(moves) if moves else []
        sets = []
        for c, slot in enumerate(new_rows):
            row = self._slots[slot]
            row.beam_index = c
            row.feed = prompt + list(search.running[c])
            row.fed = len(row.feed)
            sets.append((slot, search.running[c][-1], written))
        self._beam_sets += sets  # one beam_set for every search at the end of `_consume`
        self._beam_copies += copies
        group.rows = new_rows
        group.ready = True  # its rows decode in the next step

    def _finish_beams(self, group: _BeamGroup) -> None:
        """Posts a finished search's answer on the request (the best hypothesis as its
        tokens; the best num_return_sequences in `Finished.beams`) and frees its rows."""
        seq = group.primary
        p = seq.request.params
        hyps = tuple(BeamHypothesis(ids, self.tokenizer.decode(
            list(ids), skip_special_tokens=p.skip_special_tokens), score, reason)
            for ids, score, reason in group.search.results(p.num_return_sequences))
        best = hyps[0]
        for slot in group.rows:
            self._slots[slot].finished = True
            self._free_slot(slot)
        seq.num_generated = len(best.token_ids)
        if best.token_ids:
            seq.handle.post(Token(best.token_ids, best.text))
        stop = best.token_ids[-1] if best.finish_reason == "stop" and \
            best.token_ids[-1] not in self.eos_token_ids else None
        self.stats["finished"] += 1  # counted before the client can see the end
        self.stats["tokens"] += len(best.token_ids)
        seq.handle.post(Finished(best.finish_reason, seq.input_tokens, len(best.token_ids),
                                 stop, "", seq.cached_tokens or 0, hyps))

    def _consume(self, pending: Pending) -> None:
        out = pending.output
        tokens = np.asarray(out.tokens)
        logprobs = np.asarray(out.logprobs)
        top_ids = np.asarray(out.top_ids)
        top_lps = np.asarray(out.top_logprobs)
        B = self.num_slots
        for col, slot, seq in pending.owners:
            if self._slots[slot] is not seq or seq.finished:
                continue
            self.grammar.consumed(slot)
            if seq.beam is not None:
                self._beam_output(seq, top_ids[0, col], top_lps[0, col])
                continue
            steps = tokens.shape[0] if col < B else 1
            if pending.emitted is not None:
                steps = int(pending.emitted[col])
            for k in range(steps):
                seq.add_token(int(tokens[k, col]), float(logprobs[k, col]),
                              top_ids[k, col], top_lps[k, col])
                self.stats["tokens"] += 1
                if seq.finished:
                    break
            if slot not in self._prefilling:  # pages its decoding filled join the cache
                self._offer_pages(slot, seq, int(self.engine.lengths[slot]))
            if seq.finished:
                self._free_slot(slot)
                self.stats["finished"] += 1  # counted before the client can see the end
                seq.post_final()
        self._flush_beams()

    def _flush_beams(self) -> None:
        """Sets every beam row that a search step moved (and makes the page copies of their
        forks) in one `beam_set` program, whatever the number of searches."""
        if self._beam_sets:
            sets, copies = self._beam_sets, self._beam_copies
            self._beam_sets, self._beam_copies = [], []
            self.state = self.engine.beam_set(self.state, sets, copies)

    def _fail_slots(self, error: BaseException) -> None:
        for i, seq in enumerate(self._slots):
            if seq is not None:
                seq.handle.post(Failed(error))
                self._free_slot(i)

    def _fail_all(self, error: BaseException) -> None:
        self._fail_slots(error)
        with self._lock:
            waiting = self._waiting.clear()
        for seq in waiting:
            seq.handle.post(Failed(error))

    def _shutdown(self) -> None:
        for i, seq in enumerate(self._slots):
            if seq is not None:
                seq.handle.post(Cancelled(seq.prompt_len, seq.num_generated, "shutdown"))
                self._free_slot(i)
        with self._lock:
            waiting = self._waiting.clear()
        for seq in waiting:
            seq.handle.post(Cancelled(seq.prompt_len, seq.num_generated, "shutdown"))


class _BeamGroup:
    """A beam request's rows (`rows[i]`: the slot of running beam i), its search, and the
    top lists its rows have returned in the current step."""

    def __init__(self, primary: Sequence, rows: list[int]):
        self.primary = primary
        self.rows = rows
        self.search: BeamSearch | None = None
        self.tops: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self.ready = False  # its rows are set for the next decode step


class _NoEvents:
    """The handle of a beam's helper rows: their request's events go out once, from the
    first row's sequence."""

    def post(self, event: Any) -> None:
        """Drops `event`."""


_NO_EVENTS = _NoEvents()


def _start_copy(output: Any) -> None:
    """Starts the device-to-host copy of a step output without waiting for it."""
    for name in ("tokens", "logprobs", "top_ids", "top_logprobs"):
        arr = getattr(output, name, None)
        if hasattr(arr, "copy_to_host_async"):
            arr.copy_to_host_async()


def _uses(seq: Sequence, lora_slot: int) -> bool:
    """Whether `seq` is served with the adapter in engine LoRA slot `lora_slot`."""
    return any(slot == lora_slot for slot, _ in seq.lora)
