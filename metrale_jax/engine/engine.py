"""`Engine`: the compiled steps over a fixed grid of shapes, and the host API that feeds them.

The KV cache is paged (`engine/pages.py`, `models/paged_attention.py`): per layer a pool of
pages `[N, ps, 2K, D]`; the engine's `PageTable` (host) gives each row the pages its tokens
need and takes them back when the row is released.

Compiled programs (each compiled once, ahead of time, and kept in `self._compiled`):
- `step` per (n, C, k) (`program_grid`): one ragged step (`steps.ragged_step`) in which the
  decode rows 0 .. n-1 each decode a token and a chunk of C prompt tokens (pieces of any
  prompts, C a chunk bucket) is prefilled along, the prompts that end in it sampling their
  first tokens; without a chunk (C = 0) `decode_steps` decode steps run in one call;
- `verify` per mixed row bucket n, with `speculative_tokens` > 0 only: speculative decoding's
  verify step (`engine/speculative.py`: each row's last token and its drafts in one forward);
- `init`: an empty `DecodeState`;
- `seed`: a row's token history set to a prefix shared from the prefix cache
  (`steps.seed_history`).
`warmup()` compiles them all; afterwards `compile_count` stays flat for any request mix (every
request parameter, page table and piece layout is data). JAX's persistent compilation cache
(EngineConfig.compilation_cache_dir) makes a second start fast.

Host API for the batching loop: `step(state, active, allowed, pieces) -> (state, out)`
(a small `StepOutput` to copy asynchronously) and `release(slot)`; the prefix cache's
`reuse_prefix`, `reserve` and `cache_pages` (host data only: which pages a row shares and which
it offers); `add(state, items)` prefills whole prompts with no row decoding (scripts, tests,
benchmarks).

Placement (`engine/placement.py`): before anything is allocated the engine chooses its mesh
and memory plan (which may choose max_slots / max_len); params are placed sharded after the
per-layer split, and every program declares its in/out shardings (`StepShardings`), so on
one device or a pod slice the same calls run.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
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
from metrale_jax.engine import compilation_cache, speculative, steps
from metrale_jax.engine.bitmask import words_for
from metrale_jax.engine.config import EngineConfig
from metrale_jax.engine.images import ImagePool
from metrale_jax.engine.pages import PageTable
from metrale_jax.engine.placement import Placement, StepShardings, place
from metrale_jax.engine.prefix_cache import PrefixCache
from metrale_jax.engine.sampling_state import SamplingState
from metrale_jax.engine.sharding import abstract_params, replicated, shard_params
from metrale_jax.engine.state import DecodeState, SlotSettings, StepOutput, settings_to_arrays
from metrale_jax.engine.step_cost import StepCost
from metrale_jax.errors import ContextLengthError, InvalidParameterError
from metrale_jax.models.quant4 import is_block_scale
from metrale_jax.models.seq2seq_ragged import split_seq2seq
from metrale_jax.models.unrolled import LayerParams, split_layers
from metrale_jax.vision.prompt import PromptImage

log = logging.getLogger(__name__)

Item = tuple[int, Sequence[int], SlotSettings]
"""One prompt for `Engine.add`: (slot, prompt token ids, settings)."""


def enable_compilation_cache(folder: str | None) -> None:
    """JAX's persistent compilation cache in `folder`, safe to share between processes
    (`engine/compilation_cache.py`); None leaves the setting alone."""
    compilation_cache.enable(folder)


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
            (`engine.params` is that `LayerParams`, its states as plain dicts of arrays).
        engine_config: slots, lengths, buckets, dtypes, mesh, memory (max_slots / max_len None
            = chosen by the memory plan).
        placement: a `Placement` already computed for this model and config (e.g. before
            loading the weights, to restore them sharded); None = computed here.
    Attributes:
        config (resolved), model_config, params, mesh, placement, memory_plan; step_cost
        (`StepCost`: the largest chunk a long prompt's later piece may fill);
        compile_count: programs compiled so far.
    """

    def __init__(self, model_config: ModelConfig, graphdef: nnx.GraphDef, params: LayerParams,
                 engine_config: EngineConfig | None = None, placement: Placement | None = None,
                 vision: tuple[nnx.GraphDef, Any] | None = None):
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
        if cfg.quantization and model_config.quantization is None:  # a float model given
            from metrale_jax.models.quantized_model import quantize_state
            model_config, graphdef, params = quantize_state(model_config, params,
                                                            cfg.quantization)
            self.model_config = model_config
        # Quantized weights keep their dtype, and so do int4 block scales (float16,
        # models/quant4.py); other floats take the compute dtype.
        params = jax.tree_util.tree_map_with_path(
            lambda path, x: jnp.asarray(x, dtype) if jnp.issubdtype(x.dtype, jnp.floating)
            and not is_block_scale(path, x) else jnp.asarray(x), params)
        # Per-layer params (models.unrolled): the stacked copy is dropped once split. An
        # encoder-decoder splits its decoder the same way (models/seq2seq_ragged.py).
        self.encoder_decoder = model_config.is_encoder_decoder
        if self.encoder_decoder and cfg.max_loras:
            raise InvalidParameterError("LoRA adapters are for decoder-only models; this is "
                                        "an encoder-decoder (translation) model",
                                        param="max_loras")
        if self.encoder_decoder and cfg.speculative_tokens:
            raise InvalidParameterError("speculative decoding is for decoder-only models",
                                        param="speculative_tokens")
        # A vision-language model: its vision encoder (replicated) and the image pool.
        self.vision = model_config.vision
        if (self.vision is None) != (vision is None):
            raise InvalidParameterError("a vision-language model needs its vision encoder "
                                        "(and only such a model has one)", param="vision")
        self.images = (ImagePool(cfg.max_images, self.vision.tokens_per_image)
                       if self.vision is not None else None)
        self._vision_def = vision[0] if vision is not None else None
        split = split_seq2seq if self.encoder_decoder else split_layers
        self.graph, layers = split(graphdef, params)
        del params
        # Plain dicts of arrays, not nnx States: every step's call flattens the params, which
        # JAX does in C++ for dicts but through Python for States (483 leaves on the default
        # model: 0.46 ms a step, about 5% of an int8 decode step).
        self.params = shard_params(LayerParams(
            nnx.to_pure_dict(layers.outer),
            tuple(nnx.to_pure_dict(layer) for layer in layers.layers)), self.mesh)
        del layers
        self.vision_params = None
        if vision is not None:
            self.vision_params = jax.device_put(
                jax.tree.map(lambda x: jnp.asarray(x, dtype), vision[1]),
                replicated(self.mesh))
        self.compile_count = 0
        self._compiled: dict[tuple, Any] = {}
        self._lock = threading.Lock()
        N, B = cfg.num_top_logprobs, cfg.max_slots
        self.vocab_size = model_config.vocab_size
        self.num_pages = cfg.resolved_num_pages
        cache = None
        # An encoder-decoder's decoder keys and values depend on its source: no prefix cache.
        if cfg.prefix_cache and not self.encoder_decoder:
            cache = PrefixCache(int(cfg.prefix_cache_share * (self.num_pages - 1)))
        self.pages = PageTable(self.num_pages, cfg.page_size, B, cfg.max_len, cache)
        # How far a long prompt's later piece may fill a chunk (the scheduler's step budget).
        self.step_cost = StepCost(model_config, cfg.chunk_buckets)
        # Host mirror of each row's position (where its next token goes), for page allocation.
        self.lengths = np.zeros(B, np.int64)
        self._sc = steps.SampleConfig(N, cfg.logprobs_mode)
        sh = StepShardings(self.mesh, model_config, cfg)
        self.shardings = sh
        self.state_shardings = sh.state
        self._all_allowed: dict[int, Any] = {}  # default grammar bitmasks, on the devices
        ss = sh.state
        self._jit_init = jax.jit(
            functools.partial(steps.init_state, model_config, B, cfg.max_len, self.num_pages,
                              cfg.page_size, self.cache_dtype, cfg.max_source_len,
                              cfg.max_images * (self.vision.tokens_per_image
                                                if self.vision is not None else 0),
                              float_dtype=jnp.dtype(cfg.dtype)),
            out_shardings=ss)
        self._state_spec = jax.tree.map(
            lambda s, sharding: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding),
            jax.eval_shape(self._jit_init), ss)
        self._params_spec = abstract_params(self.params, self.mesh)
        # LoRA adapter slots (models/lora.py): per layer, per projection (a [N, in, R],
        # b [N, R, out]), replicated; each row's weight per slot (lora_mix [B, N], zeros:
        # none) is host data.
        # An encoder-decoder: which encoded source each row's cross-attention buffers hold
        # (an id per encode, -1 none), and the row copies a beam fork still owes.
        self.source_of = np.full(B, -1, np.int64)
        self._sources_encoded = 0
        self._source_copies: list[tuple[int, int]] = []
        self.lora = None
        self.lora_mix = np.zeros((B, max(cfg.max_loras, 1)), np.float32)
        if cfg.max_loras:
            from metrale_jax.models.lora import MODULES
            from metrale_jax.weights.lora import module_shape
            N, R = cfg.max_loras, cfg.max_lora_rank
            rep = self.shardings.replicated
            self.lora = tuple(
                {m: (jax.device_put(np.zeros((N, module_shape(model_config, m)[0], R),
                                             dtype), rep),
                     jax.device_put(np.zeros((N, R, module_shape(model_config, m)[1]),
                                             dtype), rep))
                 for m in MODULES} for _ in range(model_config.num_layers))

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

    def _mask_spec(self, rows: int) -> jax.ShapeDtypeStruct:
        return _spec((rows, words_for(self.vocab_size)), jnp.uint32)

    def all_allowed(self, rows: int) -> np.ndarray:
        """A `[rows, ceil(V/32)]` uint32 grammar bitmask that allows every token."""
        return np.full((rows, words_for(self.vocab_size)), 0xFFFFFFFF, np.uint32)

    def _init_exe(self):
        return self._executable(("init",), self._jit_init)

    def _seed_exe(self):
        """The program that seeds a row's token history with a shared prefix."""
        i32 = jnp.int32
        fn = jax.jit(steps.seed_history, donate_argnums=(0,),
                     out_shardings=self.shardings.state)
        return self._executable(("seed",), fn, self._state_spec, _spec((), i32),
                                _spec((self.config.max_len,), i32), _spec((), i32),
                                _spec((), i32))

    def _encode_exe(self, length: int):
        """The encoder over R sources of `length` (a source bucket) tokens (`steps.encode`)."""
        i32, R = jnp.int32, self.config.max_prefill_batch
        fn = jax.jit(functools.partial(steps.encode, self.graph), donate_argnums=(1,),
                     out_shardings=self.shardings.state)
        return self._executable(("encode", length), fn, self._params_spec, self._state_spec,
                                _spec((R,), i32), _spec((R, length), i32), _spec((R,), i32))

    def _copy_sources_exe(self):
        """The program that gives forked beam rows their request's source."""
        i32, B = jnp.int32, self.config.max_slots
        fn = jax.jit(steps.copy_sources, donate_argnums=(0,), out_shardings=self.shardings.state)
        return self._executable(("copy_sources",), fn, self._state_spec, _spec((B,), i32),
                                _spec((B,), i32))

    def check_source(self, n: int) -> None:
        """Raises if a source (encoder input) of `n` tokens cannot be held by a row."""
        limit = self.config.max_source_len
        if n < 1:
            raise InvalidParameterError("the text to translate is empty", param="messages")
        if n > limit:
            raise ContextLengthError(
                f"the text to translate has {n} tokens, but this engine holds sources of at "
                f"most {limit} tokens (--max-source-len)")

    def _encode_sources(self, state: DecodeState, pieces: Sequence[Piece]) -> DecodeState:
        """Runs the encoder for the pieces that carry their row's source (R at a time, each
        group in the smallest source bucket holding its longest)."""
        cfg, B, R = self.config, self.config.max_slots, self.config.max_prefill_batch
        todo = [p for p in pieces if p.source]
        for at in range(0, len(todo), R):
            group = todo[at:at + R]
            longest = max(len(p.source) for p in group)
            self.check_source(longest)
            S = next(b for b in cfg.source_buckets if longest <= b)
            rows = np.full(R, B, np.int32)
            ids = np.zeros((R, S), np.int32)
            lens = np.zeros(R, np.int32)
            for i, p in enumerate(group):
                rows[i], lens[i] = p.slot, len(p.source)
                ids[i, :len(p.source)] = p.source
                self._sources_encoded += 1
                self.source_of[p.slot] = self._sources_encoded
            state = self._encode_exe(S)(self.params, state, rows, ids, lens)
        return state

    def _copy_sources(self, state: DecodeState) -> DecodeState:
        """Applies the source copies `fork` recorded (one program), if any."""
        if not self._source_copies:
            return state
        B = self.config.max_slots
        dst = np.full(B, B, np.int32)
        src = np.zeros(B, np.int32)
        for i, (d, s_) in enumerate(self._source_copies):
            dst[i], src[i] = d, s_
        self._source_copies = []
        return self._copy_sources_exe()(state, dst, src)

    def _vision_exe(self, N: int):
        """The vision encoder over N images, writing their features into the pool."""
        v = self.vision
        fn = jax.jit(functools.partial(steps.encode_images, self._vision_def),
                     donate_argnums=(1,), out_shardings=self.shardings.state)
        return self._executable(("vision", N), fn, _abstract(self.vision_params),
                                self._state_spec,
                                _spec((N, v.num_channels, v.image_size, v.image_size),
                                      jnp.float32),
                                _spec((N,), jnp.int32))

    def check_images(self, count: int) -> None:
        """Raises unless a request may send `count` images (a vision-language model's pool
        holds `max_images`; a text-only model takes none)."""
        if count and self.vision is None:
            raise InvalidParameterError("this model takes no images: it is a text-only "
                                        "model", param="messages")
        if count > self.config.max_images:
            raise InvalidParameterError(
                f"{count} images in one request; this server takes at most "
                f"{self.config.max_images} (--max-images)", param="messages")

    def _encode_images(self, state: DecodeState, pieces: Sequence[Piece]) -> DecodeState:
        """Runs the vision encoder over the pieces' images that their rows do not hold yet
        (each given a pool slot), in image buckets."""
        todo = []
        for p in pieces:
            for im in self.images.missing(p.slot, p.images):
                todo.append((self.images.assign(p.slot, im), im))
        buckets = self.config.image_buckets
        while todo:
            N = next((b for b in buckets if len(todo) <= b), buckets[-1])
            group, todo = todo[:N], todo[N:]
            v = self.vision
            pixels = np.zeros((N, v.num_channels, v.image_size, v.image_size), np.float32)
            dst = np.full(N, self.config.max_images, np.int32)
            for i, (slot, im) in enumerate(group):
                pixels[i], dst[i] = im.pixels, slot
            state = self._vision_exe(N)(self.vision_params, state, pixels, dst)
        return state

    def _beam_set_exe(self):
        """The program that moves beam rows between two decode steps (`steps.beam_set`)."""
        i32, B = jnp.int32, self.config.max_slots
        fn = jax.jit(steps.beam_set, donate_argnums=(0,), out_shardings=self.shardings.state)
        return self._executable(("beam_set",), fn, self._state_spec, _spec((B,), jnp.bool_),
                                _spec((B,), i32), _spec((B,), i32), _spec((B,), i32),
                                _spec((B,), i32))

    def beam_set(self, state: DecodeState, rows: Sequence[tuple[int, int, int]],
                 copies: Sequence[tuple[int, int]]) -> DecodeState:
        """Beam search between two decode steps: each (slot, token, position) of `rows` feeds
        `token` at `position` next; each (src, dst) of `copies` copies page src onto page
        dst (from `fork`). One program, whatever the rows and copies."""
        B = self.config.max_slots
        state = self._copy_sources(state)
        mask = np.zeros(B, np.bool_)
        tokens = np.zeros(B, np.int32)
        positions = np.zeros(B, np.int32)
        src = np.zeros(B, np.int32)
        dst = np.zeros(B, np.int32)
        for slot, token, position in rows:
            mask[slot], tokens[slot], positions[slot] = True, token, position
        for i, (a, b) in enumerate(copies):
            src[i], dst[i] = a, b
        return self._beam_set_exe()(state, mask, tokens, positions, src, dst)

    def _lora_set_exe(self):
        """The program that writes one adapter slot's weights (state of the slots donated)."""
        def put(lora, slot, weights):
            return jax.tree.map(lambda s, w: s.at[slot].set(w), lora, weights)
        slot_spec = jax.tree.map(lambda x: _spec(x.shape[1:], x.dtype), self.lora)
        fn = jax.jit(put, donate_argnums=(0,), out_shardings=self.shardings.replicated)
        return self._executable(("lora_set",), fn, _abstract(self.lora), _spec((), jnp.int32),
                                slot_spec)

    def set_lora(self, slot: int, adapter: Any | None) -> None:
        """Loads `adapter` (a `weights.lora.LoraAdapter`) into LoRA slot `slot`, or clears the
        slot (None). Its rank must be at most `max_lora_rank`; its scale is folded into b.
        Rows already using the slot see the new weights from the next step."""
        cfg = self.config
        if self.lora is None:
            raise InvalidParameterError("this engine has no LoRA slots (max_loras=0)",
                                        param="lora")
        if not 0 <= slot < cfg.max_loras:
            raise InvalidParameterError(f"LoRA slot {slot} is not in [0, {cfg.max_loras})",
                                        param="lora")
        R = cfg.max_lora_rank
        if adapter is not None and adapter.rank > R:
            raise InvalidParameterError(f"adapter rank {adapter.rank} exceeds max_lora_rank {R}",
                                        param="lora")
        dtype = jnp.dtype(cfg.dtype)
        weights = []
        for layer, slots in enumerate(self.lora):
            one = {}
            for m, (a, b) in slots.items():
                wa = np.zeros(a.shape[1:], dtype)
                wb = np.zeros(b.shape[1:], dtype)
                if adapter is not None and m in adapter.weights:
                    A, Bm = adapter.weights[m]
                    r = adapter.rank
                    wa[:, :r] = A[layer]
                    wb[:r] = Bm[layer] * adapter.scale
                one[m] = (wa, wb)
            weights.append(one)
        self.lora = self._lora_set_exe()(self.lora, np.int32(slot), tuple(weights))

    def _shape(self, n: int, chunk: int, k: int) -> steps.StepShape:
        return steps.StepShape(n, chunk, self.config.max_prefill_batch if chunk else 0, k)

    def _step_exe(self, n: int, chunk: int, k: int):
        """The ragged step of n decode rows, a chunk of `chunk` tokens and k decode steps."""
        if (exe := self._compiled.get(("step", n, chunk, k))) is not None:
            return exe  # every step asks: skip building the jit and specs (~1 ms of host time)
        cfg, i32 = self.config, jnp.int32
        B, shape = cfg.max_slots, self._shape(n, chunk, k)
        fn = jax.jit(functools.partial(steps.ragged_step, self.graph, self._sc, shape),
                     donate_argnums=(1,),
                     out_shardings=(self.shardings.state, self.shardings.replicated))
        chunk_spec = None
        if chunk:
            R = shape.finish
            chunk_spec = steps.ChunkInputs(
                _spec((chunk,), i32), _spec((chunk,), i32), _spec((chunk,), i32),
                _spec((chunk,), jnp.bool_), _spec((R,), i32), _spec((R,), i32),
                _spec((R,), i32), self._sampling_spec(R), self._mask_spec(R),
                _spec((chunk,), i32) if self.vision is not None else None)
        lora_spec = rows_spec = None
        if self.lora is not None:
            lora_spec, rows_spec = _abstract(self.lora), _spec(self.lora_mix.shape, jnp.float32)
        return self._executable(("step", n, chunk, k), fn, self._params_spec, self._state_spec,
                                _spec((B, cfg.pages_per_seq), i32), _spec((B,), jnp.bool_),
                                self._mask_spec(B), chunk_spec, lora_spec, rows_spec)

    def _verify_exe(self, n: int):
        """The verify step of rows 0 .. n-1 with `speculative_tokens` drafts each."""
        cfg, i32 = self.config, jnp.int32
        B, k = cfg.max_slots, cfg.speculative_tokens
        if (exe := self._compiled.get(("verify", n, k))) is not None:
            return exe
        fn = jax.jit(functools.partial(speculative.verify_step, self.graph, self._sc,
                                       speculative.VerifyShape(n, k)),
                     donate_argnums=(1,),
                     out_shardings=(self.shardings.state, self.shardings.replicated,
                                    self.shardings.replicated))
        lora_spec = rows_spec = None
        if self.lora is not None:
            lora_spec, rows_spec = _abstract(self.lora), _spec(self.lora_mix.shape, jnp.float32)
        return self._executable(("verify", n, k), fn, self._params_spec, self._state_spec,
                                _spec((B, cfg.pages_per_seq), i32), _spec((B,), jnp.bool_),
                                self._mask_spec(B), _spec((n, k), i32), _spec((n,), i32),
                                lora_spec, rows_spec)

    def verify(self, state: DecodeState, active: np.ndarray, allowed: np.ndarray | None,
               drafts: Sequence[Sequence[int]]
               ) -> tuple[DecodeState, StepOutput, np.ndarray]:
        """One verify step (speculative decoding, `engine/speculative.py`; state donated):
        every active row feeds its last token plus its drafts (`drafts[slot]`, B lists, at most
        `speculative_tokens`; a row without drafts decodes one token) and advances by the
        tokens it emits. Pages are allocated for every position written (`OutOfPagesError`).
        Waits for the step: returns the state, StepOutput `[k + 1, B]` and emitted `[B]`
        (NumPy: row b's first emitted[b] tokens of column b are its new tokens)."""
        cfg, B, k = self.config, self.config.max_slots, self.config.speculative_tokens
        if not k:
            raise InvalidParameterError("this engine has no verify step (speculative_tokens=0)",
                                        param="speculative_tokens")
        active = np.asarray(active, np.bool_)
        used = np.flatnonzero(active)
        top = int(used[-1]) + 1 if used.size else 1
        n = next(r for r in cfg.mixed_row_buckets if top <= r)
        table = np.zeros((n, k), np.int32)
        lens = np.zeros(n, np.int32)
        cap = self.pages.pages_per_seq * cfg.page_size
        for b in used:
            d = [int(t) for t in drafts[b]][:k]
            d = d[:max(0, cap - 1 - int(self.lengths[b]))]
            table[b, :len(d)] = d
            lens[b] = len(d)
            self._ensure(int(b), int(self.lengths[b]) + 1 + len(d))
        state, out, emitted = self._verify_exe(n)(
            self.params, state, self.pages.table.copy(), active, self._allowed(B, allowed),
            table, lens, *self._lora_args())
        emitted = np.asarray(emitted)
        self.lengths[used] = np.minimum(self.lengths[used] + emitted[used], cap)
        return state, out, emitted

    def program_grid(self) -> list[tuple[int, int, int]]:
        """The (n, chunk, k) shapes warmup compiles: decode-only steps for every active-slot
        bucket, and steps with a chunk for every chunk bucket and mixed row bucket."""
        cfg = self.config
        grid = [(n, 0, cfg.decode_steps) for n in cfg.active_slot_buckets]
        grid += [(n, c, 1) for n in cfg.mixed_row_buckets for c in cfg.chunk_buckets]
        return grid

    def warmup(self, workers: int = 2,
               progress: Callable[[int, int], None] | None = None) -> float:
        """Compiles every program (`program_grid`, init, seeding, beam search's `beam_set`;
        an encoder-decoder's encoder per source bucket and `copy_sources`); returns seconds.

        progress: called as `progress(done, total)` after each program is ready (from the
        calling thread), for progress bars.
        """
        t0 = time.perf_counter()
        jobs = [self._init_exe, self._seed_exe]
        if self.config.decode_steps == 1:  # beam search's program (it needs decode_steps 1)
            jobs.append(self._beam_set_exe)
        if self.vision is not None:
            jobs += [functools.partial(self._vision_exe, N) for N in self.config.image_buckets]
        if self.encoder_decoder:
            jobs += [functools.partial(self._encode_exe, S) for S in self.config.source_buckets]
            jobs.append(self._copy_sources_exe)
        jobs += [functools.partial(self._step_exe, *shape) for shape in self.program_grid()]
        if self.config.speculative_tokens:
            jobs += [functools.partial(self._verify_exe, n)
                     for n in self.config.mixed_row_buckets]
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
        """An empty `DecodeState` (all rows idle, greedy); every page back in the pool."""
        self.pages.release_all()
        self.lengths[:] = 0
        self.lora_mix[:] = 0
        self.source_of[:] = -1
        self._source_copies = []
        if self.images is not None:
            self.images.release_all()
        return self._init_exe()()

    def _allowed(self, rows: int, allowed: np.ndarray | None):
        if allowed is not None:
            return allowed
        if rows not in self._all_allowed:
            self._all_allowed[rows] = jax.device_put(self.all_allowed(rows),
                                                     replicated(self.mesh))
        return self._all_allowed[rows]

    def check_prompt(self, n: int) -> None:
        """Raises if a prompt of `n` tokens cannot be prefilled into a slot."""
        limit = self.config.max_len - 1
        if n < 1:
            raise InvalidParameterError("the prompt is empty", param="messages")
        if n > limit:
            raise ContextLengthError(
                f"the prompt has {n} tokens, but this engine holds at most {limit} prompt "
                f"tokens (max_len {self.config.max_len} minus one for the first generated token)")

    # ---- pages -------------------------------------------------------------------------
    def release(self, slot: int) -> None:
        """Returns row `slot`'s pages to the pool (its request ended or was preempted)."""
        self.pages.release(slot)
        self.lengths[slot] = 0
        self.lora_mix[slot] = 0
        self.source_of[slot] = -1
        if self.images is not None:
            self.images.release(slot)

    def reuse_prefix(self, slot: int, keys: Sequence[str], budget: int) -> int:
        """Row `slot` shares the longest run of cached pages with `keys` (the content keys of
        its next full pages, from its first page not yet held; the row holds full pages
        only). At most `budget` of them may be idle pages (each one taken from the pool).
        A prefix shorter than `config.prefix_cache_min_tokens` in all is not shared. Returns
        the pages attached (0 without a prefix cache)."""
        cache = self.pages.cache
        if cache is None or not keys:
            return 0
        hits = cache.lookup(keys)
        for i, page in enumerate(hits):
            if self.pages.refcount[page] == 0:
                if budget <= 0:
                    hits = hits[:i]
                    break
                budget -= 1
        ps = self.config.page_size
        if (int(self.pages.owned[slot]) + len(hits)) * ps < self.config.prefix_cache_min_tokens:
            return 0
        self.pages.attach(slot, hits)
        return len(hits)

    def fork(self, moves: Sequence[tuple[int, int, int]]) -> list[tuple[int, int]]:
        """Beam search: for each (dst, src, length), row dst takes row src's first `length`
        positions: it shares src's full pages among them (as they were before the call;
        `PageTable.fork`) and gets a page of its own for a partly written last one, to be
        copied from src's (`beam_set`); its length and adapters become src's. Returns the
        (src page, dst page) copies."""
        ps = self.config.page_size
        moves = [(int(d), int(s), int(n)) for d, s, n in moves]
        partial = [(d, int(self.pages.table[s, n // ps]), n) for d, s, n in moves if n % ps]
        mix = {d: self.lora_mix[s].copy() for d, s, _ in moves}
        self.pages.fork([(d, s, n // ps) for d, s, n in moves])
        copies = []
        for dst, src_page, n in partial:
            if not self.pages.ensure(dst, n):
                raise RuntimeError("the KV page pool has no page left for a forked beam")
            copies.append((src_page, int(self.pages.table[dst, n // ps])))
        sources = {d: self.source_of[s] for d, s, _ in moves}
        for dst, src, n in moves:
            self.lengths[dst] = n
            self.lora_mix[dst] = mix[dst]
            if self.encoder_decoder and self.source_of[dst] != sources[dst]:
                self._source_copies.append((dst, src))  # made by the next beam_set
            self.source_of[dst] = sources[dst]
        return copies

    def reserve(self, slot: int, length: int) -> bool:
        """Gives row `slot` the pages for `length` positions now (before the step that writes
        them, so they can be cached at once); False when the pool is short."""
        return self.pages.ensure(slot, length)

    def cache_pages(self, slot: int, first: int, keys: Sequence[str]) -> int:
        """Offers row `slot`'s full pages `first, ...` to the prefix cache under `keys` (their
        content is written by a step launched before any step that reads them). Returns how
        many joined the cache."""
        return self.pages.register(slot, first, list(keys))

    def decode_shortfall(self, active: np.ndarray) -> int:
        """Pages the active rows need for the next `decode_steps` tokens beyond what they
        hold."""
        k = self.config.decode_steps
        return sum(self.pages.shortfall(int(b), int(self.lengths[b]) + k)
                   for b in np.flatnonzero(active))

    def _ensure(self, slot: int, length: int) -> None:
        if not self.pages.ensure(slot, length):
            raise OutOfPagesError(f"row {slot} needs {self.pages.shortfall(slot, length)} more "
                             f"pages; {self.pages.free_pages} free")

    # ---- host API ------------------------------------------------------------------------
    def step(self, state: DecodeState, active: np.ndarray | None = None,
             allowed: np.ndarray | None = None,
             pieces: Sequence[Piece] = ()) -> tuple[DecodeState, StepOutput]:
        """One ragged step (state donated): the active rows decode and `pieces` of prompts
        are prefilled along.

        active: [B] bool, the rows that decode (None = all rows holding a sequence);
        allowed: [B, ceil(V/32)] uint32 grammar bitmasks (None = every token allowed);
        pieces: prompt pieces (see `Piece`); their tokens together at most max_prefill_len, at
        most max_prefill_batch of them finishing, one per row, none on an active row; a piece
        at start > 0 attends to its row's pages before it (held: an earlier piece, or shared
        from the prefix cache). Without pieces the call runs `decode_steps` steps.
        A piece with a `prefix` seeds its row's token history first (`steps.seed_history`).
        Pages are allocated here for every position written (`OutOfPagesError` when the pool
        cannot hold them: nothing is launched then). Returns the state and
        StepOutput `[k, B + R]`: column b is row b's decode token, column B + r the first
        token of the r-th finishing piece (R = max_prefill_batch with pieces, else 0).
        """
        cfg, B = self.config, self.config.max_slots
        if self.encoder_decoder:
            state = self._encode_sources(self._copy_sources(state), pieces)
        if self.images is not None and pieces:
            state = self._encode_images(state, pieces)
        if active is None:
            active = self.lengths > 0
        active = np.asarray(active, np.bool_)
        used = np.flatnonzero(active)
        top = int(used[-1]) + 1 if used.size else 1
        for b in used:
            self._ensure(int(b), int(self.lengths[b]) + (1 if pieces else cfg.decode_steps))
        if not pieces:
            n = cfg.rows_for(top)
            out = self._step_exe(n, 0, cfg.decode_steps)(
                self.params, state, self.pages.table.copy(), active, self._allowed(B, allowed),
                None, *self._lora_args())
            self.lengths[used] = np.minimum(self.lengths[used] + cfg.decode_steps,
                                            self.pages.pages_per_seq * cfg.page_size)
            return out
        chunk, finishing = self._pack(pieces, active)
        for p in pieces:
            if p.prefix:
                state = self._seed(state, p)
        n = next(r for r in cfg.mixed_row_buckets if top <= r)
        C = int(chunk.tokens.shape[0])
        # A copy of the table: on CPU a queued step may read its NumPy inputs in place, and
        # the table changes before the next step.
        for p in pieces:
            self.lora_mix[p.slot] = 0
            for lora_slot, weight in p.lora:
                self.lora_mix[p.slot, lora_slot] = weight
        state, out = self._step_exe(n, C, 1)(self.params, state, self.pages.table.copy(),
                                             active, self._allowed(B, allowed), chunk,
                                             *self._lora_args())
        self.lengths[used] = np.minimum(self.lengths[used] + 1,
                                        self.pages.pages_per_seq * cfg.page_size)
        for piece in finishing:
            self.lengths[piece.slot] = piece.start + len(piece.tokens)
            if self.images is not None:  # its features are in the pages now
                self.images.release(piece.slot)
        return state, out

    def _lora_args(self) -> tuple:
        """The LoRA arguments of a step: the slots' weights and each row's mix (a copy)."""
        if self.lora is None:
            return (None, None)
        return (self.lora, self.lora_mix.copy())

    def _seed(self, state: DecodeState, piece: Piece) -> DecodeState:
        """Runs the `seed` program for a piece whose row shares its prefix's pages."""
        tokens = np.zeros(self.config.max_len, np.int32)
        tokens[:len(piece.prefix)] = piece.prefix
        i32 = np.int32
        return self._seed_exe()(state, i32(piece.slot), tokens, i32(len(piece.prefix)),
                                i32(piece.first_generated))

    def _pack(self, pieces: Sequence[Piece],
              active: np.ndarray) -> tuple[steps.ChunkInputs, list[Piece]]:
        """The chunk inputs of `pieces` (checked), pages allocated; and the finishing ones."""
        cfg, B = self.config, self.config.max_slots
        total = sum(len(p.tokens) for p in pieces)
        finishing = [p for p in pieces if p.settings is not None]
        R = cfg.max_prefill_batch
        if not 0 < total <= cfg.max_prefill_len:
            raise InvalidParameterError(
                f"a step's pieces hold {total} tokens; 1 .. {cfg.max_prefill_len} fit")
        if len(finishing) > R:
            raise InvalidParameterError(f"{len(finishing)} prompts end in one step; at most {R}")
        if len({p.slot for p in pieces}) < len(pieces):
            raise InvalidParameterError("two pieces for one row in a step")
        for p in pieces:
            if not 0 <= p.slot < B or active[p.slot]:
                raise InvalidParameterError(f"bad or decoding row {p.slot} for a piece")
            if p.start + len(p.tokens) > cfg.max_len - 1:
                raise ContextLengthError(f"row {p.slot}: a prompt of more than "
                                         f"{cfg.max_len - 1} tokens")
            if p.prefix and len(p.prefix) != p.start:
                raise InvalidParameterError(f"row {p.slot}: a prefix of {len(p.prefix)} "
                                            f"tokens for a piece at {p.start}")
            if self.pages.owned[p.slot] * cfg.page_size < p.start:
                raise InvalidParameterError(f"row {p.slot} holds no pages for positions "
                                            f"before {p.start}")
        need = sum(self.pages.shortfall(p.slot, p.start + len(p.tokens)) for p in pieces)
        if need > self.pages.free_pages:
            raise OutOfPagesError(f"the pieces need {need} pages; {self.pages.free_pages} free")
        for p in pieces:
            self._ensure(p.slot, p.start + len(p.tokens))
        C = cfg.chunk_bucket_for(total)
        tokens = np.zeros(C, np.int32)
        rows = np.full(C, -1, np.int32)
        positions = np.zeros(C, np.int32)
        generated = np.zeros(C, np.bool_)
        finish_index = np.zeros(R, np.int32)
        finish_steps = np.zeros(R, np.int32)
        finish_rows = np.full(R, B, np.int32)
        allowed = self.all_allowed(R)
        at = 0
        for p in pieces:
            m = len(p.tokens)
            tokens[at:at + m] = p.tokens
            rows[at:at + m] = p.slot
            positions[at:at + m] = np.arange(p.start, p.start + m)
            if p.first_generated:
                generated[at:at + m] = positions[at:at + m] >= p.first_generated
            at += m
        at = 0
        r = 0
        for p in pieces:
            at += len(p.tokens)
            if p.settings is not None:
                finish_index[r], finish_rows[r] = at - 1, p.slot
                finish_steps[r] = p.settings.generated
                if p.settings.first_mask is not None:
                    allowed[r] = p.settings.first_mask
                r += 1
        sampling = settings_to_arrays([p.settings for p in finishing], R, self.vocab_size)
        image_rows = None
        if self.images is not None:
            image_rows = np.full(C, -1, np.int32)
            at = 0
            for p in pieces:
                m = len(p.tokens)
                image_rows[at:at + m] = self.images.rows_for(p.slot, p.start, m, p.images)
                at += m
        return steps.ChunkInputs(tokens, rows, positions, generated, finish_index, finish_rows,
                                 finish_steps, sampling, allowed, image_rows), finishing

    def add(self, state: DecodeState, items: Sequence[Item],
            sources: Sequence[Sequence[int]] | None = None) -> tuple[DecodeState, StepOutput]:
        """Prefills prompts into slots and samples their first tokens (no row decodes
        meanwhile; the batching loop instead sends prompt pieces along its decode steps).

        items: (slot, prompt ids, SlotSettings) with distinct slots; each prompt is cut into
        pieces of at most max_prefill_len tokens and packed into ragged steps. sources: for
        an encoder-decoder, each item's source (encoder input ids; its prompt is then the
        decoder's, e.g. `[</s>, target language]`). state is
        donated. Returns the new state and `first: StepOutput [1, B]` (NumPy) whose column i
        is item i's first token (columns >= len(items) are zeros).
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
        for slot, _, _ in items:  # the slots' earlier sequences are replaced
            self.release(slot)
        if self.encoder_decoder and (sources is None or len(sources) != len(items)):
            raise InvalidParameterError("an encoder-decoder needs one source per prompt",
                                        param="sources")
        for source in sources or ():
            self.check_source(len(source))
        queue = [(i, Piece.cut(slot, ids, settings, cfg.max_prefill_len))
                 for i, (slot, ids, settings) in enumerate(items)]
        if sources is not None:
            queue = [(i, [dataclasses.replace(cuts[0], source=tuple(int(t) for t in src)),
                          *cuts[1:]])
                     for (i, cuts), src in zip(queue, sources, strict=True)]
        work = collections.deque((i, piece) for i, cuts in queue for piece in cuts)
        outputs: list[tuple[StepOutput, list[int]]] = []
        idle = np.zeros(B, np.bool_)
        while work:
            batch, cols = plan_pieces(work, cfg.max_prefill_len, cfg.max_prefill_batch)
            state, out = self.step(state, idle, None, batch)
            outputs.append((out, cols))
        first = StepOutput(np.zeros((1, B), np.int32), np.zeros((1, B), np.float32),
                           np.zeros((1, B, cfg.num_top_logprobs), np.int32),
                           np.zeros((1, B, cfg.num_top_logprobs), np.float32))
        for out, cols in outputs:
            host = out.to_numpy()
            for r, i in enumerate(cols):
                for name in ("tokens", "logprobs", "top_ids", "top_logprobs"):
                    getattr(first, name)[0, i] = getattr(host, name)[0, B + r]
        return state, first


class OutOfPagesError(RuntimeError):
    """The page pool cannot hold what a step would write (the host preempts or waits)."""


@dataclasses.dataclass(frozen=True)
class Piece:
    """A piece of one prompt for a ragged step: `tokens` (ids) at positions `start ..`, of
    row `slot`; `settings` is the request's `SlotSettings` on the prompt's last piece (its
    first token is sampled in the step) and None on earlier pieces. first_generated: for a
    preempted request fed again, the position of its first generated token (the tokens from
    there count as generated for the penalties); 0 = none. prefix: on a row's first piece
    when its positions before `start` are shared pages from the prefix cache, the token ids
    of those positions (they seed the row's token history); else empty. lora: the row's
    LoRA adapters as (slot, weight) pairs (empty: none), for this piece and the row's
    decoding after it. source: an encoder-decoder row's source (encoder input ids), on its
    first piece (start 0): the encoder runs over it before the step (`check_source`); else
    empty. images: a vision-language model's prompt images still ahead of the row from
    `start` on (those the row does not hold yet are encoded before the step)."""

    slot: int
    tokens: tuple[int, ...]
    start: int
    settings: SlotSettings | None
    first_generated: int = 0
    prefix: tuple[int, ...] = ()
    lora: tuple[tuple[int, float], ...] = ()
    source: tuple[int, ...] = ()
    images: tuple[PromptImage, ...] = ()

    @classmethod
    def cut(cls, slot: int, ids: Sequence[int], settings: SlotSettings,
            size: int) -> list[Piece]:
        """A prompt's pieces of `size` tokens (the last one shorter, with the settings)."""
        ids = tuple(int(t) for t in ids)
        starts = range(0, len(ids), size)
        return [cls(slot, ids[s:s + size], s, settings if s + size >= len(ids) else None)
                for s in starts]


def plan_pieces(work: collections.deque, budget: int,
                finish_limit: int) -> tuple[list[Piece], list[int]]:
    """Takes from the front of `work` ((item, Piece) pairs, in order) the pieces of one step:
    at most `budget` tokens, `finish_limit` finishing pieces, one piece per row and a row's
    pieces in order. Returns the pieces and the items of the finishing
    ones (in order)."""
    batch: list[Piece] = []
    cols: list[int] = []
    used, rows = 0, set()
    while work:
        item, piece = work[0]
        if (used + len(piece.tokens) > budget or piece.slot in rows
                or (piece.settings is not None and len(cols) >= finish_limit)):
            break
        work.popleft()
        batch.append(piece)
        used += len(piece.tokens)
        rows.add(piece.slot)
        if piece.settings is not None:
            cols.append(item)
    return batch, cols
