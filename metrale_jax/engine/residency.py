"""Moving an engine's weights off its devices and back: what a sleeping model keeps.

A sleeping engine (vLLM's sleep level 1) keeps its host copy of the params and its compiled
programs; its devices keep neither the params nor the KV pages (the scheduler that held the
`DecodeState` is stopped and dropped). Waking puts the params back with the shardings they had,
so every compiled program runs on them as before: nothing is traced or compiled again, and a
new scheduler starts on a fresh `DecodeState` (`Engine.init_decode_state`, which also empties
the prefix cache whose pages are gone).

`device_bytes_in_use()` is what the devices hold, for the memory the server reports and the
tests that check an unloaded model gave its memory back.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax


@dataclasses.dataclass
class OffloadedParams:
    """An engine's params on the host: `host` the params as numpy arrays (the engine's tree),
    `shardings` the tree of the shardings each array had on the devices."""

    host: Any
    shardings: Any

    @property
    def nbytes(self) -> int:
        """The host copy's bytes."""
        return sum(int(a.nbytes) for a in jax.tree.leaves(self.host))


def offload_params(engine: Any) -> OffloadedParams:
    """Copies `engine.params` to the host and drops the device copy (`engine.params` is None
    until `restore_params`). The engine must not be stepping (its scheduler stopped)."""
    params = engine.params
    if params is None:
        raise RuntimeError("the engine's params are already off its devices")
    shardings = jax.tree.map(lambda a: a.sharding, params)
    host = jax.device_get(params)
    engine.params = None  # the device arrays go with their last reference
    return OffloadedParams(host, shardings)


def restore_params(engine: Any, offloaded: OffloadedParams) -> None:
    """Puts offloaded params back on the devices, each with its former sharding."""
    engine.params = jax.device_put(offloaded.host, offloaded.shardings)
    jax.block_until_ready(engine.params)


def device_bytes_in_use() -> int:
    """The bytes this process's devices hold: `memory_stats()["bytes_in_use"]` summed over the
    local devices where the platform reports it, else (XLA:CPU reports nothing) the bytes of
    every live array's shards on them (from the shard shapes)."""
    total, reported = 0, True
    for device in jax.local_devices():
        try:
            stats = device.memory_stats()
        except Exception:  # some backends raise instead of returning None
            stats = None
        if not stats or "bytes_in_use" not in stats:
            reported = False
            break
        total += int(stats["bytes_in_use"])
    if reported:
        return total
    total, local = 0, set(jax.local_devices())
    for array in jax.live_arrays():  # per device: the shard shape (reading shards' data
        if array.is_deleted():       # would make new arrays, counted next time)
            continue
        devices = len(array.sharding.device_set & local)
        shard = array.sharding.shard_shape(array.shape)
        total += devices * math.prod(shard) * array.dtype.itemsize
    return total
