"""The engine's compiled programs: a cache of executables, the grid of step shapes, warmup.

`ProgramCache` compiles each program once, ahead of time, for the exact input shardings it
will run with, and counts the compiles (`compile_count`: tests hold it flat after warmup).
Every part of the engine (`StepPrograms` here, the source encoder, the image encoder, beam
forks, piece packing, LoRA slots) asks it for its programs by key; `warmup(jobs)` compiles a
list of them on a few threads. `enable_compilation_cache` turns on JAX's persistent cache
(`EngineConfig.compilation_cache_dir`), which makes a second start fast.

`StepPrograms` builds the programs of the engine contract:
- `init`: an empty `DecodeState`;
- `step` per (n, C, k) of `program_grid`: one ragged step (`steps.ragged_step`) in which the
  decode rows 0 .. n-1 each decode a token and a chunk of C prompt tokens (pieces of any
  prompts, C a chunk bucket) is prefilled along; without a chunk (C = 0) `decode_steps`
  decode steps run in one call;
- `verify` per mixed row bucket n, with `speculative_tokens` > 0 only: speculative decoding's
  verify step (`engine/speculative.py`).
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from metrale_jax.config import ModelConfig
from metrale_jax.engine import compilation_cache, speculative, steps
from metrale_jax.engine.bitmask import words_for
from metrale_jax.engine.config import EngineConfig
from metrale_jax.engine.placement import StepShardings
from metrale_jax.engine.sampling_state import SamplingState

log = logging.getLogger(__name__)

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


class ProgramCache:
    """Compiled executables by key (e.g. `("step", n, C, k)`), each compiled once.

    replicated: the sharding given to every input spec that has none (host inputs are small
    and every process passes the same values). Attributes: compile_count, programs compiled
    so far."""

    def __init__(self, replicated: NamedSharding):
        self.replicated = replicated
        self.compile_count = 0
        self._compiled: dict[tuple, Any] = {}
        self._lock = threading.Lock()

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
        exe = fn.lower(*self._placed(specs)).compile()
        with self._lock:
            if key not in self._compiled:
                self._compiled[key] = exe
                self.compile_count += 1
        log.info("compiled %s in %.2f s", key, time.perf_counter() - t0)
        return self._compiled[key]

    def _placed(self, specs: tuple) -> tuple:
        """`specs` with every leaf that has no sharding replicated: the input shardings a
        program is compiled for (params and state carry theirs)."""
        def one(s):
            if isinstance(s, jax.ShapeDtypeStruct) and s.sharding is not None:
                return s
            return jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=self.replicated)
        return jax.tree.map(one, specs)

    def warmup(self, jobs: Sequence[Job], workers: int = 2,
               progress: Callable[[int, int], None] | None = None) -> float:
        """Runs every job of `jobs` (each compiles a program) on `workers` threads; returns
        the seconds taken. progress: called as `progress(done, total)` after each job (from
        the calling thread)."""
        t0 = time.perf_counter()
        with ThreadPoolExecutor(max(1, workers)) as pool:
            futures = [pool.submit(job) for job in jobs]
            for done, f in enumerate(as_completed(futures), 1):
                f.result()
                if progress is not None:
                    progress(done, len(jobs))
        seconds = time.perf_counter() - t0
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
        self.sample_config = steps.SampleConfig(config.num_top_logprobs, config.logprobs_mode)
        pool_rows = config.max_images * (model_config.vision.tokens_per_image
                                         if self.has_images else 0)
        self._jit_init = jax.jit(
            functools.partial(steps.init_state, model_config, config.max_slots, config.max_len,
                              config.resolved_num_pages, config.page_size,
                              jnp.dtype(config.resolved_cache_dtype), config.max_source_len,
                              pool_rows, float_dtype=jnp.dtype(config.dtype),
                              stacked_pages=config.scans_layers(model_config.is_encoder_decoder)),
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
        shape = steps.StepShape(n, chunk, cfg.max_prefill_batch if chunk else 0, k)
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

    def step_jobs(self) -> list[Job]:
        """The warmup jobs of every step of `program_grid` and, with speculation, every
        verify step."""
        jobs = [functools.partial(self.step, *shape) for shape in program_grid(self.config)]
        if self.config.speculative_tokens:
            jobs += [functools.partial(self.verify, n) for n in self.config.mixed_row_buckets]
        return jobs
