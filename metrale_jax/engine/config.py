"""`EngineConfig`: the static shapes of the engine (slots, cache length, prefill buckets, dtypes).

Every field is static: changing one means new compiled programs. Request-level settings
(temperature, top-p, seeds, ...) are never here; they are per-slot data in the `DecodeState`.

`max_slots` and `max_len` may be None ("choose"): the engine's memory plan
(`engine/placement.py`) picks them from the device memory and returns a resolved copy
(`with_shapes`); the shape properties below need a resolved config.
"""

from __future__ import annotations

import dataclasses
import math
import os

import jax

from metrale_jax.config import DTYPES, KV_CACHE_DTYPES, QUANTIZATIONS, ModelConfig
from metrale_jax.engine.sharding import check_mesh_shape, parse_mesh
from metrale_jax.errors import InvalidParameterError
from metrale_jax.models.scanned import LAYER_LOOPS
from metrale_jax.models.window_cache import window_columns

SLIDING_CACHES = ("window", "full")
"""The KV caches of sliding-window layers (`EngineConfig.sliding_cache`)."""

DEFAULT_CACHE_DIR = "~/.cache/metrale/jax"
DEFAULT_PAGE_SIZE = 16


def default_layer_loop(backend: str | None = None, quantization: str | None = None,
                       layer_group: int = 1) -> str:
    """The layer loop of an engine that does not choose one, on `backend` (None: JAX's
    default) for weights of `quantization` and a model whose layer kinds repeat every
    `layer_group` layers (`models/scanned.layer_group`): "scan" on TPU and GPU, and on CPU
    for int4 weights of a model whose layers are all alike (its decode runs within a few
    percent scanned, while its programs compile in two thirds of the time and hold a third of
    the memory); "unrolled" for float and int8 weights on CPU (a decode step is 20-40% slower
    scanned there: each layer's weights are copied out of the stacked arrays;
    docs/performance.md, "Layer loop"), and for int4 weights of mixed layers (Gemma 3's six
    layers a scan step: 27 against 17 ms a decode step unrolled, measured on the 270M)."""
    if (backend or jax.default_backend()) != "cpu":
        return "scan"
    return "scan" if quantization == "int4" and layer_group == 1 else "unrolled"


def _default_cache_dir() -> str:
    return os.environ.get("METRALE_JAX_CACHE", DEFAULT_CACHE_DIR)


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """The shapes the engine compiles for.

    max_slots: B, decode slots (sequences decoded together in one step); a multiple of the
        mesh's data axis. None = as many as fit (the memory plan).
    max_len: S, cache positions per slot; a prompt may have up to `max_len - 1` tokens.
        None = chosen by the memory plan (min(the model's max positions, 4096) when it fits).
    min_prefill_bucket / max_prefill_len: prefill buckets are the powers of two between them
        (both powers of two); longer prompts are prefilled in chunks of `max_prefill_len`.
        None = 512, or the largest power of two below `max_len` when that is smaller.
        The ragged step's prefill tier: `max_prefill_len` is the token budget of one step's
        chunk (prompt tokens riding along the decode rows); the chunk buckets are
        `chunk_buckets` (min_prefill_bucket x 4^i, then max_prefill_len).
    max_prefill_batch: R, the most prompts whose prefill may end in one step (their first
        tokens sampled in it). None = min(4, max_slots).
    max_batched_prefill_len: kept for compatibility (the first engine batched prefills of
        buckets up to it); the ragged step packs prompts of any length.
    page_size: ps, positions per KV page (None = 16).
    num_pages: N, pages in the pool including the null page (None = chosen by the memory
        plan, or enough for every slot to hold max_len when the memory is unknown).
    decode_steps: k, decode steps per compiled `generate` call (k > 1: multi-step decode).
    dtype: params and activations; cache_dtype: the KV cache (None = `dtype`): "float32",
        "bfloat16" or "int8" (each key and value head of each token stored int8 with a float32
        scale, `models/kv_quant.py`: a quarter of float32's bytes per token, plus 4 a row).
    quantization: None, "int8" or "int8-all": int8 weights with per-output-channel scales
        (`models/quant.py`); "int4": 4-bit linear layers in blocks of 32 (`models/quant4.py`).
        The loaders quantize while loading, the engine quantizes a float model it is given;
        a model already quantized keeps its own.
    compilation_cache_dir: JAX's persistent compilation cache folder (None = off); defaults to
        $METRALE_JAX_CACHE or ~/.cache/metrale/jax.
    num_top_logprobs: N, the top log-probabilities returned for every sampled token.
    logprobs_mode: "raw" (the model's log-softmax, as vLLM) or "processed" (the distribution
        actually sampled from: after penalties, biases, masks, temperature and truncation).
    mesh: the device mesh (data, model): a tuple, or a string such as "data=2,model=4"
        (normalised to a tuple); None = the default for the model and the devices
        (`sharding.default_mesh_shape`). Static: slots shard over data, heads over model.
    memory_gb: GiB of memory per device for the memory plan, where the devices report none
        (CPU) or to plan for less than they have; None = what `memory_stats()` says.
    prefix_cache: full KV pages are cached by content and shared by the prompts that start
        with them (engine/prefix_cache.py); False = every prompt is prefilled whole.
    prefix_cache_share: the most of the pool (a fraction of its usable pages, 0 .. 1) that
        cached pages no running sequence holds may keep; running sequences may always use
        them all (idle cached pages are evicted first).
    prefix_cache_min_tokens: the shortest shared prefix worth reading from the cache; a
        shorter one is prefilled with the rest of the prompt. Off TPU a piece after cached
        context reads it in a loop of its own, whose fixed cost outweighs a few pages saved:
        sharing only a chat template's first page (16 tokens) made a server with no reuse 8%
        slower (bench/prefix_cache.py); 64 (4 pages) keeps that off and every real reuse on.
    max_loras: N, LoRA adapter slots on the device (0: an engine without adapters: its
        programs have no LoRA products at all); max_lora_rank: R, the largest rank a slot
        holds (smaller ranks are zero-padded).
    max_source_len: for an encoder-decoder (translation) model, the longest source (encoder
        input, in tokens) a row holds: each row keeps its source's cross-attention keys and
        values for that many positions. The encoder runs over `source_buckets`.
        Decoder-only models ignore it.
    max_images: for a vision-language model, the images whose features the device holds at
        once (the images of the prompts being prefilled; a request may send at most this
        many). The vision program runs over `image_buckets` images at a time.
    speculative_tokens: k, the most draft tokens a row verifies in one step (speculative
        decoding with prompt lookup, engine/speculative.py: one verify program per mixed
        row bucket, each row feeding k + 1 tokens); also the requests' default (0 = off:
        no verify programs). Decoder-only models.
    layer_loop: how a decoder-only model's layers run (`models/scanned.py`): "unrolled" (one
        copy of the layer per layer in every program: each weight read in place, compile
        time growing with depth), "scan" (a `lax.scan` over the stacked layers: one copy,
        compile time nearly flat in depth) or None = the default (`default_layer_loop`:
        scan on TPU and GPU and for int4 weights on CPU; unrolled for float and int8 weights
        on CPU, where the scan's per-layer weight slices cost decode speed). Encoder-decoder
        models always run unrolled.
    sliding_cache: the KV cache of a model's sliding-window layers when it has global layers
        too (Gemma 2 and 3): "window" (each row a ring of pages covering the window and the
        longest write of one step, `models/window_cache.py`: the memory of those layers does
        not grow with the context; the prefix cache is then off for the model and beam search
        is refused, as llama.cpp's small SWA cache does) or "full" (every layer keeps every
        position's page, as llama.cpp's `--swa-full`: prefix caching and beams work). None =
        "window". Models without such layers ignore it.
    pooled_output: every step with a chunk also returns, for each prompt finished in it,
        its last token's final-normed hidden state (`StepOutput.pooled`, `[R, E]` float32:
        the embedding models' last-token pooling and the decoder rerankers' head input);
        False = the steps return none (a chat engine's programs are unchanged).
        Decoder-only models.
    """

    max_slots: int | None = 8
    max_len: int | None = 2048
    min_prefill_bucket: int = 16
    max_prefill_len: int | None = None
    max_prefill_batch: int | None = None
    max_batched_prefill_len: int = 64
    decode_steps: int = 1
    dtype: str = "float32"
    cache_dtype: str | None = None
    quantization: str | None = None
    compilation_cache_dir: str | None = dataclasses.field(default_factory=_default_cache_dir)
    num_top_logprobs: int = 20
    logprobs_mode: str = "raw"
    mesh: tuple[int, int] | str | None = None
    memory_gb: float | None = None
    page_size: int | None = None
    num_pages: int | None = None
    prefix_cache: bool = True
    prefix_cache_share: float = 1.0
    prefix_cache_min_tokens: int = 64
    max_loras: int = 0
    max_lora_rank: int = 16
    max_source_len: int = 512
    max_images: int = 8
    speculative_tokens: int = 0
    layer_loop: str | None = None
    sliding_cache: str | None = None
    pooled_output: bool = False

    def __post_init__(self) -> None:
        def bad(field: str, why: str) -> InvalidParameterError:
            return InvalidParameterError(
                f"engine config: {field}={getattr(self, field)!r} {why}", param=field)

        if isinstance(self.mesh, str):
            object.__setattr__(self, "mesh", parse_mesh(self.mesh))
        elif self.mesh is not None:
            try:
                shape = tuple(int(x) for x in self.mesh)
            except (TypeError, ValueError):
                raise bad("mesh", "must be 'data=D,model=M', a (data, model) tuple or "
                                  "None") from None
            if len(shape) != 2:
                raise bad("mesh", "must have two sizes (data, model)")
            check_mesh_shape(shape, math.prod(shape))
            object.__setattr__(self, "mesh", shape)
        if self.memory_gb is not None and (
                isinstance(self.memory_gb, bool) or not isinstance(self.memory_gb, int | float)
                or not 0 < self.memory_gb < math.inf):
            raise bad("memory_gb", "must be a positive number of GiB")
        for flag in ("prefix_cache", "pooled_output"):
            if not isinstance(getattr(self, flag), bool):
                raise bad(flag, "must be True or False")
        if (not isinstance(self.speculative_tokens, int) or isinstance(
                self.speculative_tokens, bool) or not 0 <= self.speculative_tokens <= 32):
            raise bad("speculative_tokens", "must be an integer in [0, 32] (0 = off)")
        if (isinstance(self.prefix_cache_share, bool)
                or not isinstance(self.prefix_cache_share, int | float)
                or not 0.0 <= self.prefix_cache_share <= 1.0):
            raise bad("prefix_cache_share", "must be a number from 0 to 1")
        if (not isinstance(self.prefix_cache_min_tokens, int)
                or isinstance(self.prefix_cache_min_tokens, bool)
                or self.prefix_cache_min_tokens < 0):
            raise bad("prefix_cache_min_tokens", "must be an integer >= 0")
        if (not isinstance(self.max_source_len, int) or isinstance(self.max_source_len, bool)
                or self.max_source_len < 2):
            raise bad("max_source_len", "must be an integer >= 2")
        if (not isinstance(self.max_images, int) or isinstance(self.max_images, bool)
                or self.max_images < 1):
            raise bad("max_images", "must be an integer >= 1")
        for name in ("max_loras", "max_lora_rank"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise bad(name, "must be an integer >= 0")
        if self.quantization not in (None, *QUANTIZATIONS):
            raise bad("quantization", f"must be one of {QUANTIZATIONS} or None")
        if self.page_size is None:
            object.__setattr__(self, "page_size", DEFAULT_PAGE_SIZE)
        if (not isinstance(self.page_size, int) or isinstance(self.page_size, bool)
                or self.page_size <= 0 or self.page_size & (self.page_size - 1)):
            raise bad("page_size", "must be a power of two")
        if self.num_pages is not None and (not isinstance(self.num_pages, int)
                                           or isinstance(self.num_pages, bool)
                                           or self.num_pages < 2):
            raise bad("num_pages", "must be an integer >= 2 (page 0 is reserved) or None")
        if self.layer_loop is not None and self.layer_loop not in LAYER_LOOPS:
            raise bad("layer_loop", f"must be one of {LAYER_LOOPS} or None")
        if self.sliding_cache not in (None, *SLIDING_CACHES):
            raise bad("sliding_cache", f"must be one of {SLIDING_CACHES} or None")
        if self.max_slots is None or self.max_len is None:  # to be chosen by the memory plan
            self._check_unresolved(bad)
            return

        if isinstance(self.max_len, int) and self.max_len >= 1 and self.max_prefill_len is None:
            object.__setattr__(self, "max_prefill_len",
                               min(512, 1 << (self.max_len.bit_length() - 1)))
            if self.min_prefill_bucket > self.max_prefill_len:
                object.__setattr__(self, "min_prefill_bucket", self.max_prefill_len)
        if isinstance(self.max_slots, int) and self.max_prefill_batch is None:
            object.__setattr__(self, "max_prefill_batch", max(1, min(4, self.max_slots)))
        for name in ("max_slots", "max_len", "min_prefill_bucket", "max_prefill_len",
                     "max_prefill_batch", "max_batched_prefill_len", "decode_steps",
                     "num_top_logprobs"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise bad(name, "must be a positive integer")
        for name in ("min_prefill_bucket", "max_prefill_len"):
            value = getattr(self, name)
            if value & (value - 1):
                raise bad(name, "must be a power of two")
        if self.logprobs_mode not in ("raw", "processed"):
            raise bad("logprobs_mode", "must be 'raw' or 'processed'")
        if self.max_len < 2:
            raise bad("max_len", "must be at least 2")
        if self.min_prefill_bucket > self.max_prefill_len:
            raise bad("min_prefill_bucket", f"exceeds max_prefill_len={self.max_prefill_len}")
        if self.max_prefill_len > self.max_len:
            raise bad("max_prefill_len", f"exceeds max_len={self.max_len}")
        if self.max_prefill_batch > self.max_slots:
            raise bad("max_prefill_batch", f"exceeds max_slots={self.max_slots}")
        if self.dtype not in DTYPES:
            raise bad("dtype", f"must be one of {DTYPES}")
        if self.cache_dtype is not None and self.cache_dtype not in KV_CACHE_DTYPES:
            raise bad("cache_dtype", f"must be one of {KV_CACHE_DTYPES} or None")
        if self.max_slots % self.data_axis:
            raise bad("max_slots", f"must be a multiple of the mesh's data axis "
                                   f"({self.data_axis}): each data shard holds as many slots")

    def _check_unresolved(self, bad) -> None:
        """The checks that hold before the memory plan fills in max_slots / max_len."""
        for name in ("max_slots", "max_len", "min_prefill_bucket", "max_prefill_len",
                     "max_prefill_batch", "max_batched_prefill_len", "decode_steps",
                     "num_top_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                      or value <= 0):
                raise bad(name, "must be a positive integer or None")
        if self.dtype not in DTYPES:
            raise bad("dtype", f"must be one of {DTYPES}")
        if self.cache_dtype is not None and self.cache_dtype not in KV_CACHE_DTYPES:
            raise bad("cache_dtype", f"must be one of {KV_CACHE_DTYPES} or None")

    @property
    def resolved(self) -> bool:
        """True when max_slots and max_len are known (the shape properties need them)."""
        return self.max_slots is not None and self.max_len is not None

    def with_shapes(self, max_slots: int, max_len: int,
                    mesh: tuple[int, int] | None = None) -> EngineConfig:
        """A copy with max_slots, max_len (and the mesh) filled in; prefill sizes left unset
        are derived again from them; a prefill batch above the slots is lowered to them."""
        batch = self.max_prefill_batch
        return dataclasses.replace(self, max_slots=max_slots, max_len=max_len,
                                   mesh=self.mesh if mesh is None else mesh,
                                   max_prefill_batch=None if batch is None else min(batch,
                                                                                   max_slots))

    @property
    def data_axis(self) -> int:
        """The mesh's data axis size (1 while the mesh is None, i.e. not chosen yet)."""
        return 1 if self.mesh is None else int(self.mesh[0])

    @property
    def prefill_buckets(self) -> tuple[int, ...]:
        """The prefill lengths P: powers of two from `min_prefill_bucket` to `max_prefill_len`."""
        out, p = [], self.min_prefill_bucket
        while p <= self.max_prefill_len:
            out.append(p)
            p *= 2
        return tuple(out)

    @property
    def prefill_batch_sizes(self) -> tuple[int, ...]:
        """The prefill batch sizes: 1, 2, 4, ... below `max_prefill_batch`, then it."""
        out, b = [], 1
        while b < self.max_prefill_batch:
            out.append(b)
            b *= 2
        return (*out, self.max_prefill_batch)

    def prefill_batch_sizes_for(self, bucket: int) -> tuple[int, ...]:
        """The prefill batch sizes compiled for `bucket`: all of them up to
        `max_batched_prefill_len`, only 1 above it."""
        return self.prefill_batch_sizes if bucket <= self.max_batched_prefill_len else (1,)

    def scans_layers(self, encoder_decoder: bool = False,
                     quantization: str | None = None, layer_group: int = 1) -> bool:
        """Whether the engine runs a model's layers as a scan (`layer_loop`, None:
        `default_layer_loop` for the backend, the model's weight `quantization` and its
        `layer_group`); never for an encoder-decoder (`encoder_decoder`)."""
        if encoder_decoder:
            return False
        return (self.layer_loop or default_layer_loop(
            quantization=quantization, layer_group=layer_group)) == "scan"

    def window_columns(self, model: ModelConfig) -> int:
        """W, the ring pages per row of `model`'s sliding-window layers with the window cache
        (`sliding_cache`, `models/window_cache.py`), or 0 when its layers keep full pages:
        "full" asked for, an encoder-decoder, no sliding layer, no global layer (every layer
        windowed: its pages are the prefix cache's), or a ring as long as max_len. The
        longest write of one row in one step is the largest chunk (`max_prefill_len`, 512
        unset), `decode_steps` or a verify step's `speculative_tokens + 1`."""
        kinds = model.layer_is_sliding
        if (self.sliding_cache == "full" or model.is_encoder_decoder
                or model.sliding_window is None or all(kinds) or not any(kinds)):
            return 0
        longest = max(self.max_prefill_len or 512, self.decode_steps,
                      self.speculative_tokens + 1)
        columns = window_columns(model.sliding_window, longest, self.page_size)
        return columns if self.max_len is None or columns < self.pages_per_seq else 0

    @property
    def resolved_cache_dtype(self) -> str:
        """The KV cache dtype name."""
        return self.cache_dtype or self.dtype

    @property
    def active_slot_buckets(self) -> tuple[int, ...]:
        """The slot counts `generate` is compiled for: d, 2d, 4d, ... below `max_slots`, then
        it, where d is the mesh's data axis (1, 2, 4, ... on one data shard).

        A step computes only the first `rows` slots, the smallest bucket that covers the
        highest slot in use (the scheduler fills the lowest free slots first). Starting at d
        keeps every bucket a multiple of the data axis, so the rows a step computes still
        split evenly over the data shards."""
        out, b = [], self.data_axis
        while b < self.max_slots:
            out.append(b)
            b *= 2
        return (*out, self.max_slots)

    @property
    def chunk_buckets(self) -> tuple[int, ...]:
        """The chunk sizes C of the ragged step's prefill tier: min_prefill_bucket x 4^i
        below max_prefill_len, then max_prefill_len."""
        out, c = [], self.min_prefill_bucket
        while c < self.max_prefill_len:
            out.append(c)
            c *= 4
        return (*out, self.max_prefill_len)

    @property
    def image_buckets(self) -> tuple[int, ...]:
        """The image counts the vision program is compiled for: powers of two below
        max_images, then max_images."""
        out, c = [], 1
        while c < self.max_images:
            out.append(c)
            c *= 2
        return (*out, self.max_images)

    @property
    def source_buckets(self) -> tuple[int, ...]:
        """The source lengths the encoder program is compiled for: powers of two from 16
        below max_source_len, then max_source_len."""
        out, c = [], 16
        while c < self.max_source_len:
            out.append(c)
            c *= 2
        return (*out, self.max_source_len)

    def chunk_bucket_for(self, tokens: int) -> int:
        """The smallest chunk bucket holding `tokens` (<= max_prefill_len)."""
        for c in self.chunk_buckets:
            if tokens <= c:
                return c
        raise ValueError(f"{tokens} tokens exceed the chunk budget {self.max_prefill_len}")

    @property
    def mixed_row_buckets(self) -> tuple[int, ...]:
        """The decode rows computed by a step that also runs a chunk: the smallest active-slot
        bucket and all slots (a chunk costs more than the rows it rides with, so two
        buckets, not all of them, keep the compiled grid small)."""
        return tuple(sorted({self.active_slot_buckets[0], self.max_slots}))

    @property
    def pages_per_seq(self) -> int:
        """PPS: page-table columns, the pages of a `max_len` sequence."""
        return -(-self.max_len // self.page_size)

    @property
    def resolved_num_pages(self) -> int:
        """N: `num_pages`, or (unset) enough pages for every slot to hold max_len, plus the
        null page."""
        if self.num_pages is not None:
            return self.num_pages
        return self.max_slots * self.pages_per_seq + 1

    def rows_for(self, used: int) -> int:
        """The smallest active-slot bucket holding slots `0 .. used-1`."""
        for b in self.active_slot_buckets:
            if used <= b:
                return b
        raise ValueError(f"{used} slots exceed max_slots")

    def bucket_for(self, length: int) -> int:
        """The smallest bucket that holds `length` tokens (`length <= max_prefill_len`)."""
        for p in self.prefill_buckets:
            if length <= p:
                return p
        raise ValueError(f"{length} tokens exceed the largest prefill bucket")

    def batch_size_for(self, n: int) -> int:
        """The smallest prefill batch size that holds `n` prompts (`n <= max_prefill_batch`)."""
        for b in self.prefill_batch_sizes:
            if n <= b:
                return b
        raise ValueError(f"{n} prompts exceed max_prefill_batch")
