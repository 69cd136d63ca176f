"""The transformer's params unrolled per layer: the CPU-fast layout the engine runs there.

Checkpoints hold stacked `[L, ...]` params (`models/transformer.py`); a loop over them
(`models/scanned.py`, the default on TPU and GPU) copies each layer's weights out of the
stacked arrays on XLA:CPU, about 20% of a decode step's speed. `LayerParams` holds one params
pytree per layer instead, and `models/ragged.py` runs the layers as a Python loop (one traced
body per layer shape), so each weight is read in place.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from flax import nnx

from metrale_jax.config import ModelConfig
from metrale_jax.models.layers import AxesTable
from metrale_jax.models.transformer import BLOCK_AXES, TRANSFORMER_AXES

# Logical axes of `LayerParams`, keyed by its fields (engine/sharding.py maps them to the mesh).
LAYER_PARAMS_AXES: AxesTable = {
    "outer": {k: v for k, v in TRANSFORMER_AXES.items() if k != "blocks"},
    "layers": BLOCK_AXES,
}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LayerParams:
    """The model's params with one pytree per layer.

    outer: the `Transformer` state with its `blocks` entry removed (embed, final norm, head);
    layers: L `Block` states (no leading L axis).
    """

    outer: nnx.State
    layers: tuple[nnx.State, ...]


@dataclasses.dataclass(frozen=True)
class LayerGraph:
    """The static half: the model's config, its graphdef and one block's graphdef."""

    cfg: ModelConfig
    graphdef: nnx.GraphDef
    block_def: nnx.GraphDef


def layer_of(x: jax.Array, i: int) -> jax.Array:
    """Layer `i` of a stacked `[L, ...]` array, a copy. On one CPU device of a single process
    it is sliced on the host (a zero-copy view, then one transfer): indexing on the device
    would compile a dynamic slice per weight shape, ~0.5 s of every start for the default
    model. (In a multi-process run the slice stays a device op: an array committed to one
    local device could not then be placed on the global mesh.)"""
    devices = getattr(x, "devices", lambda: set())()
    if (isinstance(x, jax.Array) and len(devices) == 1 and jax.process_count() == 1
            and next(iter(devices)).platform == "cpu"):
        return jax.device_put(np.asarray(x)[i], next(iter(devices)))
    return x[i]


def split_layers(graphdef: nnx.GraphDef, params: nnx.State) -> tuple[LayerGraph, LayerParams]:
    """Stacked params -> (static `LayerGraph`, `LayerParams`). Copies each layer's weights once."""
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    model = nnx.merge(graphdef, abstract)
    cfg = model.cfg
    block_def = nnx.split(model.blocks)[0]
    blocks = params["blocks"]
    layers = tuple(jax.tree.map(lambda x, i=i: layer_of(x, i), blocks)
                   for i in range(cfg.num_layers))
    outer = nnx.State({k: v for k, v in params.items() if k != "blocks"})
    return LayerGraph(cfg, graphdef, block_def), LayerParams(outer, layers)


__all__ = ["LAYER_PARAMS_AXES", "LayerGraph", "LayerParams", "split_layers"]
