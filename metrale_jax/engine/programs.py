"""The engine's compiled programs: a cache of executables, the grid of step shapes, warmup.

`ProgramCache` compiles each program once, ahead of time, for the exact input shardings it
will run with, and counts the compiles (`compile_count`: tests hold it flat after warmup).
Every part of the engine (`StepPrograms` here, the source encoder, the image encoder, beam
forks, piece packing, LoRA slots) asks it for its programs by key; `warmup(jobs)` compiles a
list of them on a few threads, and `warmup_in_background(jobs)` the same on a thread of its
own while the engine already runs the programs compiled first. `enable_compilation_cache`
turns on JAX's persistent cache (`EngineConfig.compilation_cache_dir`), which makes a second
start fast.

`StepPrograms` builds the programs of the engine contract:
- `init`: an empty `DecodeState`;
- `step` per (n, C, k) of `program_grid`: one ragged step (`steps.ragged_step`) in which the
  decode rows 0 .. n-1 each decode a token and a chunk of C prompt tokens (pieces of any
  prompts, C a chunk bucket) is prefilled along, up to the logits; without a chunk (C = 0)
  `decode_steps` decode steps run in one call;
- `sample` per (n, R): the draw of a chunk step's n + R tokens (`steps.sample_rows`), its
  own program so that the sampler (the largest part of a small model's step to compile) is
  compiled once per row bucket instead of into every chunk shape; decode steps keep it fused
  (one decode program per row bucket anyway, and the decode loop is where a second program
  per token cost 5% of float32 decode);
- `verify` per mixed row bucket n, with `speculative_tokens` > 0 only: speculative decoding's
  verify step (`engine/speculative.py`; sampling fused: its acceptance reads the draws).

While a background warmup runs, `decode_rows`, `mixed_shape`, `verify_rows` and `chunk_limit`
choose among the programs already compiled (a larger row bucket, a larger chunk bucket, or a
smaller chunk limit for the prompt pieces), so no request waits for a compile; once the grid
is complete they choose the exact buckets.
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import logging
import queue
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from metrale_jax.config import ModelConfig
from metrale_jax.engine import compilation_cache, speculative, steps
from metrale_jax.engine.bitmask import words_for
from metrale_jax.engine.config import EngineConfig
from metrale_jax.engine.executable_store import ExecutableStore, compile_fresh
from metrale_jax.engine.placement import StepShardings
from metrale_jax.engine.router_stats import RouterStats
from metrale_jax.engine.sampling_state import SamplingState
from metrale_jax.host_memory import release_free_memory
from metrale_jax.models.scanned import layer_group

log = logging.getLogger(__name__)

COMPILE_THREAD = "metrale-compile"
"""The name (prefix) of the threads that warmups compile on."""

Job = Callable[[], Any]
"""A call that compiles one program (or finds it compiled), for `ProgramCache.warmup`."""


def enable_compilation_cache(folder: str | None) -> None:
    """JAX's persistent compilation cache in `folder`, safe to share between processes
    (`engine/compilation_cache.py`); None leaves the setting alone."""
    compilation_cache.enable(folder)


def spec(shape: tuple[int, ...], dtype: Any, sharding: Any = None) -> jax.ShapeDtypeStruct:
    """The abstract array of a program input: `shape`, `dtype`, and its sharding (None: the
    cache replicates it)."""
    return jax.ShapeDtypeStruct(shape, jnp.dtype(dtype), sharding=sharding)


def abstract(tree: Any) -> Any:
    """ShapeDtypeStructs (with shardings where known) of a pytree of arrays."""
    def one(x):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))
    return jax.tree.map(one, tree)


def program_grid(config: EngineConfig) -> list[tuple[int, int, int]]:
    """The (n, chunk, k) step shapes warmup compiles: decode-only steps for every active-slot
    bucket, and steps with a chunk for every chunk bucket and mixed row bucket."""
    grid = [(n, 0, config.decode_steps) for n in config.active_slot_buckets]
    grid += [(n, c, 1) for n in config.mixed_row_buckets for c in config.chunk_buckets]
    return grid


_BACKGROUND: weakref.WeakSet[ProgramCache] = weakref.WeakSet()
"""The caches that started a background warmup (`warmup_in_background`)."""


@atexit.register
def end_background_compiles() -> None:
    """At interpreter exit: every background warmup skips the programs not started and this
    waits for those compiling (a thread left inside XLA while Python tears down aborts the
    process: "terminate called after throwing an instance of ''", exit 134)."""
    for cache in list(_BACKGROUND):
        cache.cancel_background(timeout=None)


def run_jobs(jobs: Sequence[Callable[[], Any]], workers: int,
             progress: Callable[[int, int], None] | None = None) -> None:
    """Runs every job on `workers` daemon threads (`COMPILE_THREAD`_i); `progress(done,
    total)` is called from the calling thread after each; the first job's error is raised
    once every job has ended. Daemon threads: the interpreter's exit does not wait for the
    jobs not started (a `ThreadPoolExecutor`'s workers are joined before `atexit` hooks run,
    running every job still queued), so `end_background_compiles` can skip them."""
    pending: queue.SimpleQueue[int] = queue.SimpleQueue()
    for i in range(len(jobs)):
        pending.put(i)
    ended: queue.SimpleQueue[BaseException | None] = queue.SimpleQueue()

    def work() -> None:
        while True:
            try:
                i = pending.get_nowait()
            except queue.Empty:
                return
            try:
                jobs[i]()
                ended.put(None)
            except BaseException as e:  # handed to the calling thread
                ended.put(e)

    for w in range(min(max(1, workers), len(jobs))):
        threading.Thread(target=work, name=f"{COMPILE_THREAD}_{w}", daemon=True).start()
    error: BaseException | None = None
    for done in range(1, len(jobs) + 1):
        e = ended.get()
        error = error or e
        if progress is not None and e is None:
            progress(done, len(jobs))
    if error is not None:
        raise error


class ProgramCache:
    """Compiled executables by key (e.g. `("step", n, C, k)`), each compiled once.

    replicated: the sharding given to every input spec that has none (host inputs are small
    and every process passes the same values); store: where compiled programs are kept and
    loaded from without tracing (`executable_store.py`; None: nowhere). Attributes:
    compile_count, programs compiled (or loaded) so far; fresh_count, those XLA compiled
    (not loaded from the executable store or JAX's persistent cache); compiled_on, the name of
    the thread
    that compiled each key (warmups compile on `COMPILE_THREAD` threads; any other name: a
    program compiled on first use)."""

    def __init__(self, replicated: NamedSharding, store: ExecutableStore | None = None):
        self.replicated = replicated
        self.store = store
        self.compile_count = 0
        self.fresh_count = 0
        self._compiled: dict[tuple, Any] = {}
        self._lock = threading.Lock()
        self.compiled_on: dict[tuple, str] = {}  # the thread that compiled each program
        self._background: threading.Thread | None = None
        self._progress: list[Any] = [0, 0, None, None]  # done, total, start, end
        self._cancelled = False  # `cancel_background` was called: skip what is left

    def get(self, key: tuple) -> Any | None:
        """The executable compiled under `key`, or None."""
        return self._compiled.get(key)

    def compiled_keys(self) -> list[tuple]:
        """The keys of every program compiled so far."""
        return list(self._compiled)

    def compile(self, key: tuple, fn: Any, *specs: Any) -> Any:
        """The executable of the jitted `fn` for inputs `specs` (pytrees of
        ShapeDtypeStructs), compiled on the first call for `key` (safe from several
        threads: a race compiles twice but counts and keeps one)."""
        exe = self._compiled.get(key)
        if exe is not None:
            return exe
        t0 = time.perf_counter()
        placed = self._placed(specs)
        exe = self.store.load(key, placed) if self.store is not None else None
        fresh = False
        if exe is None:
            exe, fresh = compile_fresh(lambda: fn.lower(*placed))
            if self.store is not None and fresh:
                self.store.save(key, placed, exe)
        with self._lock:
            if key not in self._compiled:
                self._compiled[key] = exe
                self.compiled_on[key] = threading.current_thread().name
                self.compile_count += 1
                self.fresh_count += int(fresh)
        log.debug("compiled %s in %.2f s", key, time.perf_counter() - t0)
        return self._compiled[key]

    def _placed(self, specs: tuple) -> tuple:
        """`specs` with every leaf that has no sharding replicated: the input shardings a
        program is compiled for (params and state carry theirs)."""
        def one(s):
            if isinstance(s, jax.ShapeDtypeStruct) and s.sharding is not None:
                return s
            return jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=self.replicated)
        return jax.tree.map(one, specs)

    @property
    def compiling(self) -> bool:
        """True while a background warmup (`warmup_in_background`) still runs."""
        return self._background is not None and self._background.is_alive()

    def background_status(self) -> dict[str, Any]:
        """The background warmup's progress: `{"done", "total", "complete", "seconds"}`
        (programs compiled of those it was given; complete: it ended, or none was started;
        seconds: how long it ran, or has run so far)."""
        done, total, t0, t1 = self._progress
        end = t1 if t1 is not None else time.perf_counter()
        return {"done": done, "total": total, "complete": not self.compiling,
                "seconds": round(end - t0, 1) if t0 is not None else 0.0}

    def warmup_in_background(self, jobs: Sequence[Job], workers: int = 2) -> None:
        """Runs `jobs` (as `warmup`) on a daemon thread and returns at once; `compiling` is
        True until they are all done. Progress goes to the log and `background_status`; a
        failed compile is logged and stops nothing (that shape compiles on first use)."""
        self._progress = [0, len(jobs), time.perf_counter(), None]

        def progress(done: int, total: int) -> None:
            self._progress[0] = done
            log.info("background compile: %d of %d programs", done, total)

        def run() -> None:
            try:
                seconds = self.warmup(jobs, workers, progress)
                log.info("background compile: the grid is complete (%d programs in %.1f s)",
                         len(jobs), seconds)
            except Exception:
                log.exception("background compile failed")
            finally:
                self._progress[3] = time.perf_counter()

        log.info("background compile: %d programs to go, serving meanwhile", len(jobs))

        self._background = threading.Thread(target=run, name=COMPILE_THREAD, daemon=True)
        self._background.start()
        _BACKGROUND.add(self)

    def cancel_background(self, timeout: float | None = 30.0) -> None:
        """Stops a background warmup: the programs not started are skipped (those compiling
        finish); waits up to `timeout` s for it to end (its engine is being let go)."""
        self._cancelled = True
        self.wait_background(timeout)

    def wait_background(self, timeout: float | None = None) -> bool:
        """Waits for the background warmup (if any); True when it has ended."""
        if self._background is not None:
            self._background.join(timeout)
        return not self.compiling

    def warmup(self, jobs: Sequence[Job], workers: int = 2,
               progress: Callable[[int, int], None] | None = None) -> float:
        """Runs every job of `jobs` (each compiles a program) on `workers` threads; returns
        the seconds taken. progress: called as `progress(done, total)` after each job (from
        the calling thread)."""
        t0 = time.perf_counter()

        def unless_cancelled(job: Job) -> Any:
            return None if self._cancelled else job()

        run_jobs([functools.partial(unless_cancelled, job) for job in jobs], workers, progress)
        seconds = time.perf_counter() - t0
        release_free_memory()  # what the compiler freed (about 10% of the resident set)
        log.info("warmup: %d programs in %.1f s", self.compile_count, seconds)
        return seconds


class StepPrograms:
    """The programs of the engine contract: `init`, `step(n, C, k)` and `verify(n)`.

    Built from the config, the model's `graph` (per-layer, `models/unrolled.py` or
    `models/seq2seq_ragged.py`), the shardings, the abstract params and the LoRA slots'
    input specs (`LoraSlots.specs()`, (None, None) without slots). Attributes: state_spec,
    the abstract `DecodeState` (with its shardings) every program takes; params_spec."""

    def __init__(self, cache: ProgramCache, config: EngineConfig, model_config: ModelConfig,
                 graph: Any, shardings: StepShardings, params_spec: Any,
                 lora_specs: tuple[Any, Any]):
        self.cache, self.config, self.graph = cache, config, graph
        self.shardings, self.params_spec, self.lora_specs = shardings, params_spec, lora_specs
        self.vocab_size = model_config.vocab_size
        self.has_images = model_config.vision is not None
        self.router_stats = (RouterStats(model_config.num_layers, model_config.num_experts)
                             if model_config.is_moe else None)
        self.sample_config = steps.SampleConfig(config.num_top_logprobs, config.logprobs_mode)
        pool_rows = config.max_images * (model_config.vision.tokens_per_image
                                         if self.has_images else 0)
        self._jit_init = jax.jit(
            functools.partial(steps.init_state, model_config, config.max_slots, config.max_len,
                              config.resolved_num_pages, config.page_size,
                              jnp.dtype(config.resolved_cache_dtype), config.max_source_len,
                              pool_rows, float_dtype=jnp.dtype(config.dtype),
                              stacked_pages=config.scans_layers(
                                  model_config.is_encoder_decoder,
                                  model_config.quantization, layer_group(model_config)),
                              window_columns=config.window_columns(model_config),
                              pooled=config.pooled_output),
            out_shardings=shardings.state)
        self.state_spec = jax.tree.map(
            lambda s, sharding: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding),
            jax.eval_shape(self._jit_init), shardings.state)

    def sampling_spec(self, rows: int) -> SamplingState:
        """The abstract `SamplingState` of `rows` rows."""
        return abstract(SamplingState.host_defaults(rows, self.vocab_size))

    def mask_spec(self, rows: int) -> jax.ShapeDtypeStruct:
        """The abstract `[rows, ceil(V/32)]` uint32 grammar bitmasks."""
        return spec((rows, words_for(self.vocab_size)), jnp.uint32)

    def init(self) -> Any:
        """The program that makes an empty `DecodeState`."""
        return self.cache.compile(("init",), self._jit_init)

    def step(self, n: int, chunk: int, k: int) -> Any:
        """The ragged step of n decode rows, a chunk of `chunk` tokens and k decode steps."""
        if (exe := self.cache.get(("step", n, chunk, k))) is not None:
            return exe  # every step asks: skip building the jit and specs (~1 ms of host time)
        cfg, i32 = self.config, jnp.int32
        B = cfg.max_slots
        shape = steps.StepShape(n, chunk, self.finish_rows(chunk), k,
                                pooled=bool(chunk) and cfg.pooled_output)
        fn = jax.jit(functools.partial(steps.ragged_step, self.graph, self.sample_config, shape),
                     donate_argnums=(1,),
                     out_shardings=(self.shardings.state, self.shardings.replicated))
        chunk_spec = None
        if chunk:
            R = shape.finish
            chunk_spec = steps.ChunkInputs(
                spec((chunk,), i32), spec((chunk,), i32), spec((chunk,), i32),
                spec((chunk,), jnp.bool_), spec((R,), i32), spec((R,), i32),
                spec((R,), i32), self.sampling_spec(R), self.mask_spec(R),
                spec((chunk,), i32) if self.has_images else None)
        return self.cache.compile(("step", n, chunk, k), fn, self.params_spec, self.state_spec,
                                  spec((B, cfg.pages_per_seq), i32), spec((B,), jnp.bool_),
                                  self.mask_spec(B), chunk_spec, *self.lora_specs)

    def sample(self, n: int, finish: int) -> Any:
        """The sampling program of a one-token step with n decode rows and `finish` (R)
        prompts that may end in it (`steps.sample_rows`): one per (n, R), shared by every
        chunk size."""
        if (exe := self.cache.get(("sample", n, finish))) is not None:
            return exe
        M = n + finish
        fn = jax.jit(functools.partial(steps.sample_rows, self.sample_config,
                                       steps.SampleShape(n, finish)),
                     donate_argnums=(0,),
                     out_shardings=(self.shardings.state, self.shardings.replicated))
        inputs = steps.SampleInputs(spec((M, self.vocab_size), jnp.float32),
                                    spec((M,), jnp.int32), spec((M,), jnp.bool_),
                                    spec((M,), jnp.int32), spec((M,), jnp.int32),
                                    self.mask_spec(M))
        return self.cache.compile(("sample", n, finish), fn, self.state_spec, inputs)

    def run(self, n: int, chunk: int, k: int, *args: Any) -> tuple[Any, Any]:
        """Runs the step (n, chunk, k) on `args` (those of `steps.ragged_step` after the
        params) and, for a step with a chunk, its sampling program: (state, StepOutput
        `[k, B + R]`)."""
        state, out = self.step(n, chunk, k)(*args)
        if self.router_stats is not None:  # a mixture of experts: (out, counts [L, X])
            out, counts = out
            self.router_stats.add(counts)
        if not chunk:  # a decode step draws inside (steps.decode_steps)
            return state, out
        pooled, mean = out.pooled, out.pooled_mean
        out = dataclasses.replace(out, pooled=None, pooled_mean=None)
        state, out = self.sample(n, self.finish_rows(chunk))(state, out)
        if pooled is None:
            return state, out
        return state, dataclasses.replace(out, pooled=pooled, pooled_mean=mean)

    def finish_rows(self, chunk: int) -> int:
        """R, the prompts that may end in a step with a chunk of `chunk` tokens."""
        return self.config.max_prefill_batch if chunk else 0

    def verify(self, n: int) -> Any:
        """The verify step of rows 0 .. n-1 with `speculative_tokens` drafts each."""
        cfg, i32 = self.config, jnp.int32
        B, k = cfg.max_slots, cfg.speculative_tokens
        if (exe := self.cache.get(("verify", n, k))) is not None:
            return exe
        fn = jax.jit(functools.partial(speculative.verify_step, self.graph, self.sample_config,
                                       speculative.VerifyShape(n, k)),
                     donate_argnums=(1,),
                     out_shardings=(self.shardings.state, self.shardings.replicated,
                                    self.shardings.replicated))
        return self.cache.compile(("verify", n, k), fn, self.params_spec, self.state_spec,
                                  spec((B, cfg.pages_per_seq), i32), spec((B,), jnp.bool_),
                                  self.mask_spec(B), spec((n, k), i32), spec((n,), i32),
                                  *self.lora_specs)

    def init_jobs(self) -> list[Job]:
        """The warmup job of `init`."""
        return [self.init]

    def ready(self, n: int, chunk: int, k: int) -> bool:
        """True when the step (n, chunk, k) and its sampling program are both compiled."""
        if self.cache.get(("step", n, chunk, k)) is None:
            return False
        return not chunk or self.cache.get(("sample", n, self.finish_rows(chunk))) is not None

    def decode_rows(self, top: int) -> int:
        """The rows n a decode step over slots 0 .. top-1 computes: the smallest active-slot
        bucket holding them, or, while the grid compiles in the background and that one is
        not ready, the smallest ready one above it (so that no request waits for a compile)."""
        cfg = self.config
        exact = cfg.rows_for(top)
        if self.cache.compiling:
            for n in cfg.active_slot_buckets:
                if n >= exact and self.ready(n, 0, cfg.decode_steps):
                    return n
        return exact

    def mixed_shape(self, top: int, tokens: int) -> tuple[int, int]:
        """The (n, C) of a step with a chunk of `tokens` prompt tokens beside slots
        0 .. top-1: the smallest buckets holding them, or, while the grid compiles in the
        background and that step is not ready, the smallest ready one above it."""
        cfg = self.config
        n0 = next(r for r in cfg.mixed_row_buckets if top <= r)
        c0 = cfg.chunk_bucket_for(tokens)
        if self.cache.compiling:
            for c in cfg.chunk_buckets:
                for n in cfg.mixed_row_buckets:
                    if c >= c0 and n >= n0 and self.ready(n, c, 1):
                        return n, c
        return n0, c0

    def verify_rows(self, top: int) -> int:
        """The rows a verify step over slots 0 .. top-1 computes (as `mixed_shape`'s n)."""
        cfg = self.config
        n0 = next(r for r in cfg.mixed_row_buckets if top <= r)
        if self.cache.compiling:
            for n in cfg.mixed_row_buckets:
                key = ("verify", n, cfg.speculative_tokens)
                if n >= n0 and self.cache.get(key) is not None:
                    return n
        return n0

    def chunk_limit(self) -> int:
        """The most prompt tokens one step may carry now: `max_prefill_len`, or, while the
        grid compiles in the background, the largest chunk bucket ready for every row count
        (so that `mixed_shape` always finds a ready step for a chunk within it)."""
        cfg = self.config
        if self.cache.compiling:
            rows = cfg.mixed_row_buckets[-1]
            ready = [c for c in cfg.chunk_buckets if self.ready(rows, c, 1)]
            if ready:
                return ready[-1]
        return cfg.max_prefill_len

    def step_jobs(self, part: str = "all") -> list[Job]:
        """The warmup jobs of the steps of `program_grid`, each after its sampling program,
        and, with speculation, the verify steps. part: "all"; "first", the few that serve
        any request (the largest row bucket's decode step, its step with the smallest
        chunk, the largest verify step); "rest", the others, cheapest and most used first
        (decode buckets upwards, then chunks upwards): a server compiles them in the
        background (`ProgramCache.warmup_in_background`) while it serves."""
        cfg = self.config
        B, k, rows = cfg.max_slots, cfg.decode_steps, cfg.mixed_row_buckets
        first = [(B, 0, k), (rows[-1], cfg.chunk_buckets[0], 1)]
        rest = [(n, 0, k) for n in cfg.active_slot_buckets if n != B]
        rest += [(n, c, 1) for c in cfg.chunk_buckets for n in rows if (n, c, 1) not in first]
        shapes = {"all": first + rest, "first": first, "rest": rest}[part]
        spec_rows = rows if cfg.speculative_tokens else ()
        verify = {"all": spec_rows, "first": spec_rows[-1:], "rest": spec_rows[:-1]}[part]
        jobs: list[Job] = []
        sampled: set[tuple[int, int]] = set()
        for n, c, steps_k in shapes:
            if c and (n, self.finish_rows(c)) not in sampled:
                sampled.add((n, self.finish_rows(c)))
                jobs.append(functools.partial(self.sample, n, self.finish_rows(c)))
            jobs.append(functools.partial(self.step, n, c, steps_k))
        return jobs + [functools.partial(self.verify, n) for n in verify]
