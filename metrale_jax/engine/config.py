"""`EngineConfig`: the static shapes of the engine (slots, cache length, prefill buckets, dtypes).

Every field is static: changing one means new compiled programs. Request-level settings
(temperature, top-p, seeds, ...) are never here; they are per-slot data in the `DecodeState`.
"""

from __future__ import annotations

import dataclasses
import os

from metrale_jax.config import DTYPES
from metrale_jax.errors import InvalidParameterError

DEFAULT_CACHE_DIR = "~/.cache/metrale/jax"


def _default_cache_dir() -> str:
    return os.environ.get("METRALE_JAX_CACHE", DEFAULT_CACHE_DIR)


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """The shapes the engine compiles for.

    max_slots: B, decode slots (sequences decoded together in one step).
    max_len: S, cache positions per slot; a prompt may have up to `max_len - 1` tokens.
    min_prefill_bucket / max_prefill_len: prefill buckets are the powers of two between them
        (both powers of two); longer prompts are prefilled in chunks of `max_prefill_len`.
        None = 512, or the largest power of two below `max_len` when that is smaller.
    max_prefill_batch: the largest number of prompts prefilled in one call; batches are padded
        to 1, 2, 4, ... up to it. None = min(4, max_slots).
    max_batched_prefill_len: buckets up to this length are prefilled in batches; longer
        prompts one at a time (on CPU a long prompt fills the machine alone, and each batch
        size is one more program to compile).
    decode_steps: k, decode steps per compiled `generate` call (k > 1: multi-step decode).
    dtype: params and activations; cache_dtype: the KV cache (None = `dtype`).
    compilation_cache_dir: JAX's persistent compilation cache folder (None = off); defaults to
        $METRALE_JAX_CACHE or ~/.cache/metrale/jax.
    num_top_logprobs: N, the top log-probabilities returned for every sampled token.
    logprobs_mode: "raw" (the model's log-softmax, as vLLM) or "processed" (the distribution
        actually sampled from: after penalties, biases, masks, temperature and truncation).
    """

    max_slots: int = 8
    max_len: int = 2048
    min_prefill_bucket: int = 16
    max_prefill_len: int | None = None
    max_prefill_batch: int | None = None
    max_batched_prefill_len: int = 64
    decode_steps: int = 1
    dtype: str = "float32"
    cache_dtype: str | None = None
    compilation_cache_dir: str | None = dataclasses.field(default_factory=_default_cache_dir)
    num_top_logprobs: int = 20
    logprobs_mode: str = "raw"

    def __post_init__(self) -> None:
        def bad(field: str, why: str) -> InvalidParameterError:
            return InvalidParameterError(
                f"engine config: {field}={getattr(self, field)!r} {why}", param=field)

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
        if self.cache_dtype is not None and self.cache_dtype not in DTYPES:
            raise bad("cache_dtype", f"must be one of {DTYPES} or None")

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

    @property
    def resolved_cache_dtype(self) -> str:
        """The KV cache dtype name."""
        return self.cache_dtype or self.dtype

    @property
    def active_slot_buckets(self) -> tuple[int, ...]:
        """The slot counts `generate` is compiled for: 1, 2, 4, ... below `max_slots`, then it.

        A step computes only the first `rows` slots, the smallest bucket that covers the
        highest slot in use (the scheduler fills the lowest free slots first)."""
        out, b = [], 1
        while b < self.max_slots:
            out.append(b)
            b *= 2
        return (*out, self.max_slots)

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
