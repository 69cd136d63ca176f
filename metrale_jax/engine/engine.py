"""`Engine`: the compiled steps over a fixed grid of shapes, and the host API that feeds them.

Compiled programs (each compiled once, ahead of time, and kept in `self._compiled`):
- `prefill_insert` per (bucket P, prefill batch Bp; batches only for P up to
  `max_batched_prefill_len`): prompts prefilled, their first tokens sampled with the slots'
  settings (so time to first token is one prefill), and written into the slots of the donated
  `DecodeState`: DESIGN.md's `prefill` and `insert` fused into one program, which halves the
  programs to compile;
- `chunk` (P = max_prefill_len, one prompt): a chunk of a prompt longer than the largest
  bucket, prefilled straight into its slot's cache, attending to the earlier chunks there;
- `generate` per active-slot bucket n (1, 2, 4, ... B): `decode_steps` decode steps of
  slots 0 .. n-1, state donated;
- `init`: an empty `DecodeState`.
`warmup()` compiles them all; afterwards `compile_count` stays flat for any request mix (every
request parameter is data). JAX's persistent compilation cache (EngineConfig.
compilation_cache_dir) makes a second start fast. The contract's separate `prefill(...)` and
`insert(...)` stay available (for disaggregated or custom loops); they compile on first use.

Host API for the batching loop: `add(state, items) -> (state, first)` and
`step(state, active) -> (state, out)`; both return small `StepOutput`s to copy
asynchronously.

Placement (`engine/placement.py`): before anything is allocated the engine chooses its mesh
and memory plan (which may choose max_slots / max_len); params are placed sharded after the
per-layer split, and every program declares its in/out shardings (`StepShardings`), so on
one device or a pod slice the same calls run.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from metrale_jax.config import ModelConfig
from metrale_jax.engine import steps
from metrale_jax.engine.bitmask import words_for
from metrale_jax.engine.config import EngineConfig
from metrale_jax.engine.placement import Placement, StepShardings, place
from metrale_jax.engine.sampling_state import SamplingState
from metrale_jax.engine.sharding import abstract_params, shard_params
from metrale_jax.engine.state import DecodeState, SlotSettings, StepOutput, settings_to_arrays
from metrale_jax.errors import ContextLengthError, InvalidParameterError
from metrale_jax.models.unrolled import LayerParams, split_layers

log = logging.getLogger(__name__)

Item = tuple[int, Sequence[int], SlotSettings]
"""One prompt for `Engine.add`: (slot, prompt token ids, settings)."""


def enable_compilation_cache(folder: str | None) -> None:
    """Turns on JAX's persistent compilation cache in `folder` for every compile, small or fast
    ones included (CPU compiles are quick but many). None leaves the setting alone."""
    if folder is None:
        return
    folder = os.path.expanduser(folder)
    os.makedirs(folder, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", folder)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def _abstract(tree: Any) -> Any:
    """ShapeDtypeStructs (with shardings where known) of a pytree of arrays."""
    def one(x):
        sharding = getattr(x, "sharding", None)
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
    return jax.tree.map(one, tree)


def _spec(shape: tuple[int, ...], dtype, sharding=None) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, jnp.dtype(dtype), sharding=sharding)


class Engine:
    """Compiled prefill/insert/decode for one model over the shapes of an `EngineConfig`.

    Args:
        model_config: the architecture.
        graphdef, params: the split NNX `Transformer` (stacked `[L, ...]` params, on one
            device or already sharded, e.g. by a sharded orbax restore); they are cast to
            `engine_config.dtype`, split per layer once and placed on the mesh
            (`engine.params` is that `LayerParams`).
        engine_config: slots, lengths, buckets, dtypes, mesh, memory (max_slots / max_len None
            = chosen by the memory plan).
        placement: a `Placement` already computed for this model and config (e.g. before
            loading the weights, to restore them sharded); None = computed here.
    Attributes:
        config (resolved), model_config, params, mesh, placement, memory_plan;
        compile_count: programs compiled so far.
    """

    def __init__(self, model_config: ModelConfig, graphdef: nnx.GraphDef, params: LayerParams,
                 engine_config: EngineConfig | None = None, placement: Placement | None = None):
        placement = placement or place(model_config, engine_config or EngineConfig())
        cfg = placement.config
        self.config = cfg
        self.placement = placement
        self.memory_plan = placement.plan
        self.model_config = model_config
        enable_compilation_cache(cfg.compilation_cache_dir)
        self.mesh = placement.make_mesh()
        dtype = jnp.dtype(cfg.dtype)
        self.cache_dtype = jnp.dtype(cfg.resolved_cache_dtype)
        params = jax.tree.map(lambda x: jnp.asarray(x, dtype), params)
        # Per-layer params (models.unrolled): the stacked copy is dropped once split.
        self.graph, layers = split_layers(graphdef, params)
        del params
        self.params = shard_params(layers, self.mesh)
        del layers
        self.compile_count = 0
        self._compiled: dict[tuple, Any] = {}
        self._lock = threading.Lock()
        N, B = cfg.num_top_logprobs, cfg.max_slots
        self.vocab_size = model_config.vocab_size
        sc = steps.SampleConfig(N, cfg.logprobs_mode)
        sh = StepShardings(self.mesh, model_config, cfg)
        self.shardings = sh
        self.state_shardings = sh.state
        self._all_allowed: Any = None  # `generate`'s default grammar bitmask, on the devices
        # Out shardings are declared here; in shardings by the specs each program is lowered
        # with (`_executable`: params and state carry theirs, host inputs are replicated).
        ss, rep = sh.state, sh.replicated
        self._jit_init = jax.jit(
            functools.partial(steps.init_state, model_config, B, cfg.max_len, self.cache_dtype),
            out_shardings=ss)
        self._jit_prefill = jax.jit(
            functools.partial(steps.prefill_step, self.graph, sc, self.cache_dtype),
            out_shardings=sh.prefix)
        self._jit_insert = jax.jit(steps.insert_step, donate_argnums=(1, 4),
                                   out_shardings=(ss, rep))
        self._jit_prefill_insert = jax.jit(
            functools.partial(steps.prefill_insert_step, self.graph, sc, self.cache_dtype),
            donate_argnums=(1, 2), out_shardings=(ss, rep))
        self._jit_chunk = jax.jit(functools.partial(steps.chunk_step, self.graph, sc),
                                  donate_argnums=(1, 2), out_shardings=(ss, rep))
        self._jit_generate = {
            n: jax.jit(functools.partial(steps.generate_step, self.graph, sc, cfg.decode_steps, n),
                       donate_argnums=(1,), out_shardings=(ss, rep))
            for n in cfg.active_slot_buckets}
        self._state_spec = jax.tree.map(
            lambda s, sharding: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding),
            jax.eval_shape(self._jit_init), ss)
        self._params_spec = abstract_params(self.params, self.mesh)
        self._first_spec = StepOutput(_spec((1, B), jnp.int32, rep),
                                      _spec((1, B), jnp.float32, rep),
                                      _spec((1, B, N), jnp.int32, rep),
                                      _spec((1, B, N), jnp.float32, rep))

    # ---- compiled programs -------------------------------------------------------------
    def _executable(self, key: tuple, fn, *specs):
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
        program is compiled for (params and state carry theirs; host inputs are small and
        every process passes the same values)."""
        rep = self.shardings.replicated

        def one(s):
            if isinstance(s, jax.ShapeDtypeStruct) and s.sharding is not None:
                return s
            return jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=rep)
        return jax.tree.map(one, specs)

    def _sampling_spec(self, rows: int) -> SamplingState:
        return _abstract(SamplingState.host_defaults(rows, self.vocab_size))

    def _prefill_exe(self, P: int, Bp: int):
        i32 = jnp.int32
        return self._executable(("prefill", P, Bp), self._jit_prefill, self._params_spec,
                                _spec((Bp, P), i32), _spec((Bp,), i32), self._sampling_spec(Bp))

    def _insert_exe(self, P: int, Bp: int):
        prefix = jax.eval_shape(self._jit_prefill, self._params_spec, _spec((Bp, P), jnp.int32),
                                _spec((Bp,), jnp.int32), self._sampling_spec(Bp))
        return self._executable(("insert", P, Bp), self._jit_insert, prefix, self._state_spec,
                                _spec((Bp,), jnp.int32), _spec((Bp,), jnp.int32),
                                self._first_spec)

    def _prefill_insert_exe(self, P: int, Bp: int):
        i32 = jnp.int32
        return self._executable(("prefill_insert", P, Bp), self._jit_prefill_insert,
                                self._params_spec, self._state_spec, self._first_spec,
                                _spec((Bp, P), i32), _spec((Bp,), i32), self._sampling_spec(Bp),
                                _spec((Bp,), i32), _spec((Bp,), i32), self._mask_spec(Bp))

    def _chunk_exe(self):
        P, i32 = self.config.max_prefill_len, jnp.int32
        scalar = _spec((), i32)
        return self._executable(("chunk", P), self._jit_chunk, self._params_spec,
                                self._state_spec, self._first_spec, scalar, scalar,
                                _spec((1, P), i32), scalar, scalar, self._sampling_spec(1),
                                self._mask_spec(1))

    def _generate_exe(self, rows: int):
        B = self.config.max_slots
        return self._executable(("generate", self.config.decode_steps, rows),
                                self._jit_generate[rows], self._params_spec, self._state_spec,
                                _spec((B,), jnp.bool_), self._mask_spec(B))

    def _mask_spec(self, rows: int) -> jax.ShapeDtypeStruct:
        return _spec((rows, words_for(self.vocab_size)), jnp.uint32)

    def all_allowed(self, rows: int) -> np.ndarray:
        """A `[rows, ceil(V/32)]` uint32 grammar bitmask that allows every token."""
        return np.full((rows, words_for(self.vocab_size)), 0xFFFFFFFF, np.uint32)

    def _init_exe(self):
        return self._executable(("init",), self._jit_init)

    def warmup(self, workers: int = 2,
               progress: Callable[[int, int], None] | None = None) -> float:
        """Compiles every program (all buckets and prefill batch sizes); returns seconds.

        progress: called as `progress(done, total)` after each program is ready (from the
        calling thread), for progress bars.
        """
        t0 = time.perf_counter()
        cfg = self.config
        jobs = [self._init_exe, self._chunk_exe]
        jobs += [functools.partial(self._generate_exe, n) for n in cfg.active_slot_buckets]
        for P in cfg.prefill_buckets:
            for Bp in cfg.prefill_batch_sizes_for(P):
                jobs.append(functools.partial(self._prefill_insert_exe, P, Bp))
        with ThreadPoolExecutor(max(1, workers)) as pool:
            futures = [pool.submit(job) for job in jobs]
            for done, f in enumerate(as_completed(futures), 1):
                f.result()
                if progress is not None:
                    progress(done, len(jobs))
        seconds = time.perf_counter() - t0
        log.info("warmup: %d programs in %.1f s", self.compile_count, seconds)
        return seconds

    # ---- the engine contract -----------------------------------------------------------
    def init_decode_state(self) -> DecodeState:
        """An empty `DecodeState` (all slots idle, greedy)."""
        return self._init_exe()()

    def empty_first(self) -> StepOutput:
        """A zero `StepOutput [1, B]` for `insert`/`prefill_chunk` to write first tokens into."""
        return jax.tree.map(lambda s: jax.device_put(np.zeros(s.shape, s.dtype), s.sharding),
                            self._first_spec)

    def prefill(self, params: LayerParams, tokens: np.ndarray, lengths: np.ndarray,
                sampling: SamplingState) -> steps.Prefix:
        """Prefills `Bp` prompts of one bucket. tokens: [Bp, P] int32 (P a bucket, Bp a
        prefill batch size); lengths: [Bp] int32 in 1..P; sampling: [Bp] rows (see
        `settings_to_arrays`). Returns the `Prefix` (first tokens sampled)."""
        Bp, P = tokens.shape
        return self._prefill_exe(P, Bp)(params, tokens, lengths, sampling)

    def insert(self, prefix: steps.Prefix, state: DecodeState, slots: np.ndarray,
               cols: np.ndarray | None = None,
               first: StepOutput | None = None) -> tuple[DecodeState, StepOutput]:
        """Puts `prefix` row b into slot `slots[b]` (B = padding, dropped); state donated.
        Its first token goes to column `cols[b]` (default `slots`) of `first` ([1, B],
        donated; default a fresh one). Returns (state, first)."""
        Bp, P = prefix.cache.k.shape[1], prefix.cache.k.shape[3]  # k: [L, Bp, K, P, D]
        slots = np.asarray(slots, np.int32)
        cols = slots if cols is None else np.asarray(cols, np.int32)
        first = self.empty_first() if first is None else first
        return self._insert_exe(P, Bp)(prefix, state, slots, cols, first)

    def prefill_chunk(self, params: LayerParams, state: DecodeState, first: StepOutput, slot: int,
                      col: int, tokens: np.ndarray, start: int, length: int,
                      sampling: SamplingState,
                      allowed: np.ndarray | None = None) -> tuple[DecodeState, StepOutput]:
        """One `max_prefill_len` chunk of a long prompt into `slot` (see `steps.chunk_step`);
        allowed: [1, ceil(V/32)] uint32, the first token's grammar bitmask (None = all)."""
        i32 = np.int32
        allowed = self.all_allowed(1) if allowed is None else allowed
        return self._chunk_exe()(params, state, first, i32(slot), i32(col), tokens, i32(start),
                                 i32(length), sampling, allowed)

    def generate(self, params: LayerParams, state: DecodeState,
                 active: np.ndarray | None = None,
                 allowed: np.ndarray | None = None) -> tuple[DecodeState, StepOutput]:
        """`decode_steps` decode steps; state donated. Out: StepOutput [k, B].

        active: [B] bool, the slots that advance (None = all; a slot not active keeps its
        state). Only the smallest active-slot bucket covering the highest active slot is
        computed, and attention reads the cache up to the largest active position.
        allowed: [B, ceil(V/32)] uint32 grammar bitmasks (None = every token allowed).
        """
        B = self.config.max_slots
        if active is None:
            active = np.ones(B, np.bool_)
        active = np.asarray(active, np.bool_)
        if allowed is None:
            if self._all_allowed is None:
                self._all_allowed = jax.device_put(self.all_allowed(B),
                                                   self.shardings.replicated)
            allowed = self._all_allowed
        used = np.flatnonzero(active)
        rows = self.config.rows_for(int(used[-1]) + 1 if used.size else 1)
        return self._generate_exe(rows)(params, state, active, allowed)

    # ---- host API ------------------------------------------------------------------------
    def check_prompt(self, n: int) -> None:
        """Raises if a prompt of `n` tokens cannot be prefilled into a slot."""
        limit = self.config.max_len - 1
        if n < 1:
            raise InvalidParameterError("the prompt is empty", param="messages")
        if n > limit:
            raise ContextLengthError(
                f"the prompt has {n} tokens, but this engine holds at most {limit} prompt "
                f"tokens (max_len {self.config.max_len} minus one for the first generated token)")

    def add(self, state: DecodeState, items: Sequence[Item]) -> tuple[DecodeState, StepOutput]:
        """Prefills prompts into slots and samples their first tokens.

        items: (slot, prompt ids, SlotSettings) with distinct slots. Prompts up to
        `max_prefill_len` are grouped by bucket into padded batches of the prefill batch
        sizes; longer ones are prefilled in chunks. state is donated. Returns the new state and
        `first: StepOutput [1, B]` whose column i is item i's first token (columns
        >= len(items) are zeros).
        """
        cfg, B = self.config, self.config.max_slots
        if len(items) > B:
            raise InvalidParameterError(f"{len(items)} prompts for {B} slots", param="slots")
        seen: set[int] = set()
        for slot, ids, _ in items:
            if not 0 <= slot < B or slot in seen:
                raise InvalidParameterError(f"bad or repeated slot {slot}", param="slots")
            seen.add(slot)
            self.check_prompt(len(ids))
        first = self.empty_first()
        by_bucket: dict[int, list[int]] = {}
        long: list[int] = []
        for i, (_, ids, _) in enumerate(items):
            if len(ids) <= cfg.max_prefill_len:
                by_bucket.setdefault(cfg.bucket_for(len(ids)), []).append(i)
            else:
                long.append(i)
        for P, idx in sorted(by_bucket.items()):
            most = max(cfg.prefill_batch_sizes_for(P))
            for j in range(0, len(idx), most):
                group = idx[j:j + most]
                Bp = cfg.batch_size_for(len(group))
                tokens = np.zeros((Bp, P), np.int32)
                lengths = np.ones(Bp, np.int32)
                slots = np.full(Bp, B, np.int32)
                cols = np.full(Bp, B, np.int32)
                for r, i in enumerate(group):
                    slot, ids, _ = items[i]
                    tokens[r, :len(ids)] = ids
                    lengths[r], slots[r], cols[r] = len(ids), slot, i
                sampling = settings_to_arrays([items[i][2] for i in group], Bp,
                                              self.vocab_size)
                allowed = self.all_allowed(Bp)
                for r, i in enumerate(group):
                    if items[i][2].first_mask is not None:
                        allowed[r] = items[i][2].first_mask
                state, first = self._prefill_insert_exe(P, Bp)(
                    self.params, state, first, tokens, lengths, sampling, slots, cols, allowed)
        P = cfg.max_prefill_len
        for i in long:
            slot, ids, settings = items[i]
            ids = np.asarray(ids, np.int32)
            sampling = settings_to_arrays([settings], 1, self.vocab_size)
            allowed = self.all_allowed(1)
            if settings.first_mask is not None:
                allowed[0] = settings.first_mask
            for start in range(0, len(ids), P):
                chunk = ids[start:start + P]
                tokens = np.zeros((1, P), np.int32)
                tokens[0, :len(chunk)] = chunk
                state, first = self.prefill_chunk(self.params, state, first, slot, i, tokens,
                                                  start, len(chunk), sampling, allowed)
        return state, first

    def step(self, state: DecodeState, active: np.ndarray | None = None,
             allowed: np.ndarray | None = None) -> tuple[DecodeState, StepOutput]:
        """`generate` with the engine's params: state donated; StepOutput [k, B].

        active: [B] bool, the slots that advance (None = all); allowed: [B, ceil(V/32)]
        uint32 grammar bitmasks (None = all tokens); see `generate`.
        """
        return self.generate(self.params, state, active, allowed)
