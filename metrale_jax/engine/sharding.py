"""Logical axis names -> mesh axes, and the `("data", "model")` mesh of the local devices.

Arrays declare logical axis names beside their shapes (`KV_CACHE_AXES` in models/kv_cache.py,
`SLOT_AXES` in engine/state.py); `RULES` maps each name to a mesh axis or None (replicated).
Decode slots shard over "data", heads and the MLP over "model". With one device every
sharding is trivial; the scale-out work only has to build a bigger mesh.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MESH_AXES: tuple[str, str] = ("data", "model")

RULES: dict[str, str | None] = {
    "slots": "data",
    "batch": "data",
    "layers": None,
    "seq": None,
    "head_dim": None,
    "embed": None,
    "vocab": "model",
    "heads": "model",
    "kv_heads": "model",
    "mlp": "model",
}


def make_mesh(data: int = 1, model: int = 1, devices: list | None = None) -> Mesh:
    """A `("data", "model")` mesh of `data * model` local devices (default: one device)."""
    devices = devices if devices is not None else jax.local_devices()[: data * model]
    return Mesh(np.asarray(devices).reshape(data, model), MESH_AXES)


def partition_spec(logical_axes: tuple[str | None, ...], mesh: Mesh) -> PartitionSpec:
    """The `PartitionSpec` of an array with these logical axes; a mesh axis of size 1 or one
    already used by an earlier axis leaves the axis replicated."""
    used: set[str] = set()
    spec: list[str | None] = []
    for name in logical_axes:
        axis = RULES.get(name) if name is not None else None
        if axis is None or axis in used or mesh.shape[axis] == 1:
            spec.append(None)
        else:
            used.add(axis)
            spec.append(axis)
    return PartitionSpec(*spec)


def named_sharding(logical_axes: tuple[str | None, ...], mesh: Mesh) -> NamedSharding:
    """The `NamedSharding` of an array with these logical axes on `mesh`."""
    return NamedSharding(mesh, partition_spec(logical_axes, mesh))
