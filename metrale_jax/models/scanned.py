"""The decoder's layers as one `lax.scan`: stacked params and one stacked KV page pool.

The engine runs a decoder-only model's layers in one of two forms (`EngineConfig.layer_loop`):
- unrolled (`models/unrolled.py`): one params pytree and one page pool `[N, ps, 2K, D]` per
  layer, the layers a Python loop: every weight read in place, but each compiled program holds
  L copies of the layer, so compile time grows with depth;
- scanned (this module): `StackedLayerParams`, every block leaf with its leading `[L, ...]`
  axis as the checkpoint holds it, and one pool `[L, N, ps, 2K, D]` for all layers; the
  layers run as a `lax.scan` over groups of `layer_group(cfg)` layers (Gemma 2 alternates
  sliding and global layers: a group is one pair), so a program holds one group's body
  whatever the depth.

The scanned pool is never sliced per layer (a dynamic slice of it copies the layer's pool on
XLA:CPU). Inside the scan it is seen as `[L*N, ps, 2K, D]` (a free reshape) and layer l's page
p is page `l*N + p`: the step's slots and page tables are offset by the layer (`models/ragged.py`,
`layer_layout`), so writes scatter in place into the carried pool and reads gather straight from
it, and the CPU decode kernel reads its pages in place as it does an unrolled layer's pool.

The pool helpers (`zero_pools`, `copy_pages`, `pool_page_size`) take either form: a tuple of L
pools (unrolled) or one stacked array (scanned).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from metrale_jax.config import ModelConfig
from metrale_jax.models.layers import AxesTable, stacked_axes
from metrale_jax.models.transformer import BLOCK_AXES, TRANSFORMER_AXES
from metrale_jax.models.unrolled import LayerGraph
from metrale_jax.models.window_cache import WindowedPools

# Logical axes of `StackedLayerParams`, keyed by its fields (engine/sharding.py maps them).
STACKED_PARAMS_AXES: AxesTable = {
    "outer": {k: v for k, v in TRANSFORMER_AXES.items() if k != "blocks"},
    "blocks": stacked_axes(BLOCK_AXES),
}

LAYER_LOOPS = ("unrolled", "scan")
"""The forms of the layer loop an engine may run (`EngineConfig.layer_loop`)."""


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StackedLayerParams:
    """The model's params for the scanned layer loop.

    outer: the `Transformer` state with its `blocks` entry removed (embed, final norm, head);
    blocks: the `Block` params, every leaf stacked `[L, ...]` (int8 / int4 weights and their
    scales too).
    """

    outer: nnx.State
    blocks: nnx.State


def stack_layers(graphdef: nnx.GraphDef,
                 params: nnx.State) -> tuple[LayerGraph, StackedLayerParams]:
    """Stacked params -> (static `LayerGraph`, `StackedLayerParams`): the same arrays, split
    into the blocks and the rest (nothing copied)."""
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    model = nnx.merge(graphdef, abstract)
    block_def = nnx.split(model.blocks)[0]
    outer = nnx.State({k: v for k, v in params.items() if k != "blocks"})
    return (LayerGraph(model.cfg, graphdef, block_def),
            StackedLayerParams(outer, params["blocks"]))


def layer_group(cfg: ModelConfig) -> int:
    """G, the layers one scan iteration runs: the period of the model's layer kinds
    (`cfg.layer_is_sliding`: 1 when every layer is alike, 2 for Gemma 2's sliding/global
    pairs); L when no period divides L (the scan then has one iteration)."""
    kinds = tuple(bool(s) for s in cfg.layer_is_sliding)
    L = len(kinds)
    for g in range(1, L + 1):
        if L % g == 0 and kinds == kinds[:g] * (L // g):
            return g
    return L


def stacked_pages(pages) -> bool:
    """Whether `pages` is the scanned form's one stacked pool (else a tuple, one per layer;
    `WindowedPools`: the form of its parts)."""
    if isinstance(pages, WindowedPools):
        return stacked_pages(pages.full)
    return not isinstance(pages, tuple | list)


def zero_pools(num_layers: int, shape: tuple[int, ...], dtype, *, stacked: bool):
    """Empty KV pools for `num_layers` layers of pool `shape` `[N, ps, 2K, D]`: one array
    `[L, N, ps, 2K, D]` when `stacked`, else a tuple of L arrays."""
    if stacked:
        return jnp.zeros((num_layers, *shape), dtype)
    return tuple(jnp.zeros(shape, dtype) for _ in range(num_layers))


def copy_pages(pages, dst: jax.Array, src: jax.Array):
    """Every layer's page `dst[i]` becomes a copy of its page `src[i]` (`[M] int32` each);
    pages in either form, returned in the same form. `WindowedPools`: the global layers'
    pages only (the rings are per row, `models/window_cache.py`)."""
    if isinstance(pages, WindowedPools):
        return dataclasses.replace(pages, full=copy_pages(pages.full, dst, src))
    if stacked_pages(pages):
        return pages.at[:, dst].set(pages[:, src])
    return tuple(pool.at[dst].set(pool[src]) for pool in pages)


def pool_page_size(pages) -> int:
    """ps, positions per page, of pools in either form (or `WindowedPools`)."""
    if isinstance(pages, WindowedPools):
        return pool_page_size(pages.full)
    return (pages if stacked_pages(pages) else pages[0]).shape[-3]


__all__ = ["LAYER_LOOPS", "STACKED_PARAMS_AXES", "StackedLayerParams", "copy_pages",
           "layer_group", "pool_page_size", "stack_layers", "stacked_pages", "zero_pools"]
