"""`Engine`: one model's ragged steps over a paged KV cache and a fixed grid of shapes, and the
host API that feeds them.

The KV cache is paged (`engine/pages.py`, `models/paged_attention.py`): per layer a pool of
pages `[N, page, 2K, D]`; the engine's `PageTable` (host) gives each row the pages its tokens
need and takes them back when the row is released.

A step (`step`) runs every decoding row's token plus a chunk of C prompt tokens (pieces of
several prompts) in one compiled program, one per (n, C, k) of the grid; every request
parameter, page table and piece layout is data, so after `warmup()` `compile_count` stays flat
for any request mix. The engine owns its parts, each built here from the config, the page
table and the shardings, and only calls them:
- `programs` (`ProgramCache`, `engine/programs.py`): compiled programs, warmup, the compile
  counter; `step_programs` (`StepPrograms`): init, the steps of `program_grid`, verify;
- `packer` (`PiecePacker`, `engine/pieces.py`): prompt pieces into a step's chunk inputs;
- `lora_slots` (`LoraSlots`, `engine/lora_slots.py`): adapter weights and each row's mix;
- `sources` (`SourceEncoder`, `engine/source_encoder.py`): an encoder-decoder's encoder;
- `image_encoder` (`ImageEncoder`, `engine/image_encoder.py`): a vision model's image pool;
- `beams` (`BeamForks`, `engine/beam_forks.py`): beam search's forks and `beam_set`.

Placement (`engine/placement.py`): before anything is allocated the engine chooses its mesh
and memory plan (which may choose max_slots / max_len); params are placed sharded after the
per-layer split, and every program declares its in/out shardings (`StepShardings`), so on
one device or a pod slice the same calls run.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx

from metrale_jax.config import ModelConfig
from metrale_jax.engine import bitmask, executable_store
from metrale_jax.engine.beam_forks import BeamForks
from metrale_jax.engine.config import EngineConfig
from metrale_jax.engine.executable_store import ExecutableStore
from metrale_jax.engine.image_encoder import ImageEncoder, check_images
from metrale_jax.engine.lora_slots import LoraSlots
from metrale_jax.engine.pages import PageTable
from metrale_jax.engine.pieces import Piece, PiecePacker, check_prompt, plan_pieces, take_pages
from metrale_jax.engine.placement import Placement, StepShardings, place, place_params
from metrale_jax.engine.prefix_cache import PrefixCache
from metrale_jax.engine.programs import (
    ProgramCache,
    StepPrograms,
    enable_compilation_cache,
    program_grid,
)
from metrale_jax.engine.sharding import abstract_params
from metrale_jax.engine.source_encoder import SourceEncoder, check_source
from metrale_jax.engine.state import DecodeState, SlotSettings, StepOutput
from metrale_jax.engine.step_cost import StepCost
from metrale_jax.errors import InvalidParameterError
from metrale_jax.host_memory import release_free_memory
from metrale_jax.models.accelerator_attention import attention_path
from metrale_jax.models.unrolled import LayerParams

log = logging.getLogger(__name__)

Item = tuple[int, Sequence[int], SlotSettings]
"""One prompt for `Engine.add`: (slot, prompt token ids, settings)."""


class Engine:
    """One model's ragged steps over the shapes of an `EngineConfig` (see the module docstring).

    Args:
        model_config: the architecture.
        graphdef, params: the split NNX `Transformer` (stacked `[L, ...]` params, on one
            device or already sharded, e.g. by a sharded orbax restore); they are cast to
            `engine_config.dtype`, split per layer once and placed on the mesh
            (`placement.place_params`: `engine.params` is that `LayerParams`).
        engine_config: slots, lengths, buckets, dtypes, mesh, memory (max_slots / max_len None
            = chosen by the memory plan).
        placement: a `Placement` already computed for this model and config (e.g. before
            loading the weights, to restore them sharded); None = computed here.
        vision: a vision-language model's encoder (graphdef, params); None otherwise.
    Attributes:
        config (resolved), model_config, params, mesh, placement, memory_plan, shardings;
        pages (`PageTable`), lengths (`[B]` each row's next position); step_cost
        (`StepCost`: the largest chunk a long prompt's later piece may fill); images (the
        `ImagePool`, None for a text model); the parts named in the module docstring.
    """

    def __init__(self, model_config: ModelConfig, graphdef: nnx.GraphDef, params: LayerParams,
                 engine_config: EngineConfig | None = None, placement: Placement | None = None,
                 vision: tuple[nnx.GraphDef, Any] | None = None):
        placement = placement or place(model_config, engine_config or EngineConfig())
        cfg = self.config = placement.config
        self.placement, self.memory_plan = placement, placement.plan
        store = self._store(cfg, model_config)
        if store is None:  # JAX's persistent cache instead (see engine/executable_store.py)
            enable_compilation_cache(cfg.compilation_cache_dir)
        self.mesh = placement.make_mesh()
        self.encoder_decoder = model_config.is_encoder_decoder
        if self.encoder_decoder and cfg.max_loras:
            raise InvalidParameterError("LoRA adapters are for decoder-only models; this is "
                                        "an encoder-decoder (translation) model",
                                        param="max_loras")
        if model_config.is_moe and cfg.max_loras:
            raise InvalidParameterError("LoRA adapters are not supported on mixture-of-experts "
                                        "models (no adapter reaches the experts)",
                                        param="max_loras")
        if self.encoder_decoder and cfg.pooled_output:
            raise InvalidParameterError("pooled output is for decoder-only models",
                                        param="pooled_output")
        if self.encoder_decoder and cfg.speculative_tokens:
            raise InvalidParameterError("speculative decoding is for decoder-only models",
                                        param="speculative_tokens")
        if (model_config.vision is None) != (vision is None):
            raise InvalidParameterError("a vision-language model needs its vision encoder "
                                        "(and only such a model has one)", param="vision")
        model_config, self.graph, self.params = place_params(model_config, graphdef, params,
                                                             cfg, self.mesh)
        self.model_config, self.vocab_size = model_config, model_config.vocab_size
        # TPU: the kernel or the XLA path, decided (and logged, with why) before any step
        self.attention_path = attention_path(
            model_config.num_heads, model_config.num_kv_heads, model_config.head_dim,
            cfg.page_size, cfg.dtype, cfg.resolved_cache_dtype, self.mesh)
        B = cfg.max_slots
        self.num_pages = cfg.resolved_num_pages
        # An encoder-decoder's decoder keys and values depend on its source, and the rings of
        # sliding-window layers (models/window_cache.py) are per row: no prefix cache.
        self.window_columns = cfg.window_columns(model_config)
        cache = None
        if self.window_columns and cfg.prefix_cache:
            log.info("sliding-window layers keep a ring of %d pages per row: the prefix cache "
                     "is off (sliding_cache='full' keeps it)", self.window_columns)
        if cfg.prefix_cache and not self.encoder_decoder and not self.window_columns:
            cache = PrefixCache(int(cfg.prefix_cache_share * (self.num_pages - 1)))
        self.pages = PageTable(self.num_pages, cfg.page_size, B, cfg.max_len, cache)
        self.step_cost = StepCost(model_config, cfg.chunk_buckets)
        self.lengths = np.zeros(B, np.int64)  # each row's next position, for its pages
        self.shardings = sh = StepShardings(self.mesh, model_config, cfg)
        self._all_allowed: dict[int, Any] = {}  # default grammar bitmasks, on the devices
        # The parts.
        self.programs = ProgramCache(sh.replicated, store)
        self.lora_slots = LoraSlots(cfg, model_config, sh.replicated, self.programs)
        self.step_programs = StepPrograms(self.programs, cfg, model_config, self.graph, sh,
                                          abstract_params(self.params, self.mesh),
                                          self.lora_slots.specs())
        state_spec = self.step_programs.state_spec
        self.sources = (SourceEncoder(cfg, self.graph, self.programs, sh, state_spec,
                                      self.step_programs.params_spec)
                        if self.encoder_decoder else None)
        self.image_encoder = (ImageEncoder(cfg, model_config, *vision, self.programs, sh,
                                           state_spec) if vision is not None else None)
        self.images = self.image_encoder.pool if self.image_encoder is not None else None
        self.packer = PiecePacker(cfg, self.vocab_size, self.pages, self.images, self.programs,
                                  sh, state_spec)
        self.beams = BeamForks(cfg, self.pages, self.lengths, self.lora_slots, self.sources,
                               self.programs, sh, state_spec)
        release_free_memory()  # the loading's host copies (GGUF blocks dequantized, casts)

    @staticmethod
    def _store(cfg: EngineConfig, model_config: ModelConfig) -> ExecutableStore | None:
        """The compiled programs kept beside the persistent compilation cache (None without
        one, or when `executable_store.enabled()` says no)."""
        if cfg.compilation_cache_dir is None or not executable_store.enabled():
            return None
        folder = os.path.join(os.path.expanduser(cfg.compilation_cache_dir), "executables")
        return ExecutableStore(folder, executable_store.fingerprint(cfg, model_config))

    # ---- programs ----------------------------------------------------------------------
    @property
    def compile_count(self) -> int:
        """Programs compiled so far."""
        return self.programs.compile_count

    def router_counts(self) -> np.ndarray | None:
        """A mixture-of-experts model's tokens routed per layer and expert since start,
        `[L, X]` int64 (`engine/router_stats.py`); None for a dense model."""
        stats = self.step_programs.router_stats
        return None if stats is None else stats.totals()

    def program_grid(self) -> list[tuple[int, int, int]]:
        """The (n, chunk, k) step shapes warmup compiles (`programs.program_grid`)."""
        return program_grid(self.config)

    def warmup(self, workers: int = 2, progress: Callable[[int, int], None] | None = None,
               background: bool = False) -> float:
        """Compiles every program (init, seeding, beam search's `beam_set`, the image and
        source encoders, every step of `program_grid` and its sampling program, verify
        steps); returns seconds. progress: called as `progress(done, total)` after each
        program is ready. background: compile only the steps that serve any request now
        (`StepPrograms.step_jobs("first")`) and the rest of the grid on a thread of its own,
        returning before it ends: meanwhile each step runs in the nearest compiled shape
        (`compile_status()` shows the progress; `wait_compiled()` waits)."""
        parts = (self.image_encoder, self.sources)
        jobs = [*self.step_programs.init_jobs(), *self.packer.jobs(), *self.beams.jobs(),
                *(job for part in parts if part is not None for job in part.jobs()),
                *self.step_programs.step_jobs("first" if background else "all")]
        seconds = self.programs.warmup(jobs, workers, progress)
        if background:
            self.programs.warmup_in_background(self.step_programs.step_jobs("rest"), workers)
        return seconds

    def compile_status(self) -> dict[str, Any]:
        """The compiled programs and the background compile's progress: `{"programs",
        "background": {"done", "total", "complete", "seconds"}}`."""
        return {"programs": self.compile_count,
                "background": self.programs.background_status()}

    def wait_compiled(self, timeout: float | None = None) -> bool:
        """Waits for a background warmup to end; True when the whole grid is compiled."""
        return self.programs.wait_background(timeout)

    @property
    def chunk_limit(self) -> int:
        """The most prompt tokens a step may carry now (`StepPrograms.chunk_limit`:
        `max_prefill_len`, less while the grid compiles in the background)."""
        return self.step_programs.chunk_limit()

    def step_shape(self, active: np.ndarray, tokens: int) -> tuple[int, int]:
        """(n, C) of the program `step` runs now for the `[B]` bool `active` rows and
        `tokens` prompt tokens: n decode rows, C the chunk bucket (0: a decode-only step)."""
        used = np.flatnonzero(active)
        top = int(used[-1]) + 1 if used.size else 1
        if not tokens:
            return self.step_programs.decode_rows(top), 0
        return self.step_programs.mixed_shape(top, tokens)

    # ---- checks --------------------------------------------------------------------------
    def check_prompt(self, n: int) -> None:
        """Raises if a prompt of `n` tokens cannot be prefilled into a slot."""
        check_prompt(n, self.config.max_len)

    def check_source(self, n: int) -> None:
        """Raises if a source (encoder input) of `n` tokens cannot be held by a row."""
        check_source(n, self.config.max_source_len)

    def check_images(self, count: int) -> None:
        """Raises unless a request may send `count` images."""
        check_images(count, self.model_config, self.config.max_images)

    def all_allowed(self, rows: int) -> np.ndarray:
        """A `[rows, ceil(V/32)]` uint32 grammar bitmask that allows every token."""
        return bitmask.all_allowed(rows, self.vocab_size)

    def _allowed(self, rows: int, allowed: np.ndarray | None) -> Any:
        if allowed is not None:
            return allowed
        if rows not in self._all_allowed:
            self._all_allowed[rows] = jax.device_put(self.all_allowed(rows),
                                                     self.shardings.replicated)
        return self._all_allowed[rows]

    # ---- rows and pages (host data only) ------------------------------------------------
    def init_decode_state(self) -> DecodeState:
        """An empty `DecodeState` (all rows idle, greedy); every page back in the pool."""
        self.pages.release_all()
        self.lengths[:] = 0
        self.lora_slots.mix[:] = 0
        if self.sources is not None:
            self.sources.release_all()
        if self.images is not None:
            self.images.release_all()
        return self.step_programs.init()()

    def release(self, slot: int) -> None:
        """Returns row `slot`'s pages to the pool (its request ended or was preempted)."""
        self.pages.release(slot)
        self.lengths[slot] = 0
        self.lora_slots.mix[slot] = 0
        if self.sources is not None:
            self.sources.release(slot)
        if self.images is not None:
            self.images.release(slot)

    def reuse_prefix(self, slot: int, keys: Sequence[str], budget: int) -> int:
        """Row `slot` shares the longest run of cached pages with `keys` (the content keys of
        its next full pages; `PageTable.reuse_prefix`), at most `budget` of them idle and
        `config.prefix_cache_min_tokens` in all. Returns the pages attached."""
        return self.pages.reuse_prefix(slot, keys, budget, self.config.prefix_cache_min_tokens)

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

    def set_lora(self, slot: int, adapter: Any | None) -> None:
        """Loads `adapter` (a `weights.lora.LoraAdapter`) into LoRA slot `slot`, or clears it
        (None); `LoraSlots.set`."""
        self.lora_slots.set(slot, adapter)

    def fork(self, moves: Sequence[tuple[int, int, int]]) -> list[tuple[int, int]]:
        """Beam search: each (dst, src, length) row dst takes row src's first `length`
        positions (`BeamForks.fork`). Returns the (src page, dst page) copies for `beam_set`."""
        return self.beams.fork(moves)

    def beam_set(self, state: DecodeState, rows: Sequence[tuple[int, int, int]],
                 copies: Sequence[tuple[int, int]]) -> DecodeState:
        """Beam search between two decode steps: each (slot, token, position) of `rows` feeds
        `token` at `position` next; `copies` from `fork` are made. One program."""
        return self.beams.beam_set(state, rows, copies)

    # ---- steps ---------------------------------------------------------------------------
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
        if self.sources is not None:
            state = self.sources.encode(self.sources.copy_pending(state), self.params, pieces)
        if self.image_encoder is not None and pieces:
            state = self.image_encoder.encode(state, pieces)
        if active is None:
            active = self.lengths > 0
        active = np.asarray(active, np.bool_)
        used = np.flatnonzero(active)
        top = int(used[-1]) + 1 if used.size else 1
        cap = self.pages.pages_per_seq * cfg.page_size
        for b in used:
            take_pages(self.pages, int(b), int(self.lengths[b]) + (1 if pieces else
                                                                    cfg.decode_steps))
        if not pieces:
            out = self.step_programs.run(
                self.step_programs.decode_rows(top), 0, cfg.decode_steps, self.params, state,
                self.pages.table.copy(), active, self._allowed(B, allowed), None,
                *self.lora_slots.args())
            self.lengths[used] = np.minimum(self.lengths[used] + cfg.decode_steps, cap)
            return out
        n, C = self.step_programs.mixed_shape(top, sum(len(p.tokens) for p in pieces))
        chunk, finishing = self.packer.pack(pieces, active, C)
        for p in pieces:
            if p.prefix:
                state = self.packer.seed(state, p)
            self.lora_slots.set_row(p.slot, p.lora)
        # A copy of the table: on CPU a queued step may read its NumPy inputs in place, and
        # the table changes before the next step.
        state, out = self.step_programs.run(
            n, C, 1, self.params, state, self.pages.table.copy(),
            active, self._allowed(B, allowed), chunk, *self.lora_slots.args())
        self.lengths[used] = np.minimum(self.lengths[used] + 1, cap)
        for piece in finishing:
            self.lengths[piece.slot] = piece.start + len(piece.tokens)
            if self.images is not None:  # its features are in the pages now
                self.images.release(piece.slot)
        return state, out

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
        n = self.step_programs.verify_rows(top)
        table = np.zeros((n, k), np.int32)
        lens = np.zeros(n, np.int32)
        cap = self.pages.pages_per_seq * cfg.page_size
        for b in used:
            d = [int(t) for t in drafts[b]][:k]
            d = d[:max(0, cap - 1 - int(self.lengths[b]))]
            table[b, :len(d)] = d
            lens[b] = len(d)
            take_pages(self.pages, int(b), int(self.lengths[b]) + 1 + len(d))
        state, out, emitted = self.step_programs.verify(n)(
            self.params, state, self.pages.table.copy(), active, self._allowed(B, allowed),
            table, lens, *self.lora_slots.args())
        emitted = np.asarray(emitted)
        self.lengths[used] = np.minimum(self.lengths[used] + emitted[used], cap)
        return state, out, emitted

    def add(self, state: DecodeState, items: Sequence[Item],
            sources: Sequence[Sequence[int]] | None = None) -> tuple[DecodeState, StepOutput]:
        """Prefills prompts into slots and samples their first tokens (no row decodes
        meanwhile; the batching loop instead sends prompt pieces along its decode steps).

        items: (slot, prompt ids, SlotSettings) with distinct slots; each prompt is cut into
        pieces of at most max_prefill_len tokens and packed into ragged steps. sources: for
        an encoder-decoder, each item's source (encoder input ids; its prompt is then the
        decoder's, e.g. `[</s>, target language]`). state is donated. Returns the new state
        and `first: StepOutput [1, B]` (NumPy) whose column i is item i's first token
        (columns >= len(items) are zeros).
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
        limit = self.chunk_limit
        work = self.packer.cut_prompts(items, sources, limit)
        N = cfg.num_top_logprobs
        first = StepOutput(np.zeros((1, B), np.int32), np.zeros((1, B), np.float32),
                           np.zeros((1, B, N), np.int32), np.zeros((1, B, N), np.float32))
        outputs: list[tuple[StepOutput, list[int]]] = []
        while work:
            batch, cols = plan_pieces(work, limit, cfg.max_prefill_batch)
            state, out = self.step(state, np.zeros(B, np.bool_), None, batch)
            outputs.append((out, cols))
        for out, cols in outputs:
            host = out.to_numpy()
            for r, i in enumerate(cols):
                for name in ("tokens", "logprobs", "top_ids", "top_logprobs"):
                    getattr(first, name)[0, i] = getattr(host, name)[0, B + r]
        return state, first
