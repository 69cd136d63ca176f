"""The device-side decode state, a slot's host-side settings, and the per-step outputs.

`DecodeState` is one pytree donated to every compiled call that changes it. Slot `b` is
decoding when the host says so; the engine itself treats every slot alike (an idle slot decodes
garbage that nobody reads, and its cache writes past `S` are dropped).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np

from metrale_jax.engine.sampling import SamplingState, seed_to_key
from metrale_jax.errors import InvalidParameterError
from metrale_jax.models.unrolled import LayerCache

# Logical axis names of the per-slot arrays, beside their shapes (see engine/sharding.py).
SLOT_AXES: tuple[str, ...] = ("slots",)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeState:
    """Everything `generate` reads and writes.

    cache: LayerCache, per layer keys `[B, K, D, S]` (transposed) and values `[B, K, S, D]`.
    positions: [B] int32, where the next token goes (= the slot's current length).
    tokens: [B] int32, the last sampled token: the input of the next step.
    steps: [B] int32, the sampling step index of the next token (the first token is step 0).
    sampling: per-slot `SamplingState` ([B] arrays and keys [B, 2]).
    """

    cache: LayerCache
    positions: jax.Array
    tokens: jax.Array
    steps: jax.Array
    sampling: SamplingState


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepOutput:
    """What `k` decode steps produced, small enough to copy to the host every step.

    tokens: [k, B] int32; logprobs: [k, B] float32 (the model's log-softmax of each token);
    top_ids: [k, B, N] int32 and top_logprobs: [k, B, N] float32, the N most likely tokens.
    For `Engine.add`, k = 1 and column `i` is the i-th added item (not its slot).
    """

    tokens: jax.Array
    logprobs: jax.Array
    top_ids: jax.Array
    top_logprobs: jax.Array

    def copy_to_host_async(self) -> None:
        """Starts copying every array to the host without waiting."""
        for leaf in jax.tree.leaves(self):
            if hasattr(leaf, "copy_to_host_async"):
                leaf.copy_to_host_async()

    def to_numpy(self) -> StepOutput:
        """The same output as NumPy arrays (waits for the device)."""
        return jax.tree.map(np.asarray, self)


@dataclasses.dataclass(frozen=True)
class SlotSettings:
    """One request's sampling settings, as the host hands them to `Engine.add`.

    temperature: 0 = greedy; top_k: 0 = off; top_p in (0, 1]; min_p in [0, 1];
    seed: any integer (64 bits kept); the same seed gives the same tokens.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        def bad(field: str, why: str) -> InvalidParameterError:
            return InvalidParameterError(f"{field}={getattr(self, field)!r} {why}", param=field)

        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise bad("temperature", "must be a finite number >= 0")
        if int(self.top_k) != self.top_k or self.top_k < 0:
            raise bad("top_k", "must be an integer >= 0 (0 = off)")
        if not 0 < self.top_p <= 1:
            raise bad("top_p", "must be in (0, 1]")
        if not 0 <= self.min_p <= 1:
            raise bad("min_p", "must be in [0, 1]")
        if int(self.seed) != self.seed:
            raise bad("seed", "must be an integer")


def settings_to_arrays(settings: list[SlotSettings], batch: int) -> SamplingState:
    """NumPy `SamplingState` of `batch` rows: `settings` first, greedy padding after."""
    s = SamplingState.host_defaults(batch)
    for i, x in enumerate(settings):
        s.temperature[i] = x.temperature
        s.top_k[i] = min(int(x.top_k), np.iinfo(np.int32).max)
        s.top_p[i] = x.top_p
        s.min_p[i] = x.min_p
        s.keys[i] = seed_to_key(int(x.seed))
    return s
