"""A whole float model quantized: `quantize_state` turns a `Transformer`'s params into the
same model with int8 or int4 linear weights (`models/quant.py` and `models/quant4.py` hold
the formats and the matmuls).

Kept apart from `models/quant.py`, which the layers import: this module builds the quantized
model's abstract state from `models/transformer.py`, which imports the layers.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from metrale_jax.models.quant import (
    SCALE_SUFFIX,
    check_quantization,
    quantize_weight,
    stacked_in_axes,
)
from metrale_jax.models.transformer import abstract_model


def quantize_state(cfg: Any, params: Any, mode: str) -> tuple[Any, Any, Any]:
    """A float `Transformer`'s stacked params (`nnx.State`, on the host or a device) ->
    `(cfg, graphdef, params)` of the same model quantized with `mode` ("int8" / "int8-all" /
    "int4").
    Each weight is quantized in numpy on the host, one stacked tensor at a time; the other
    params are kept as they are."""
    check_quantization(mode)
    cfg = dataclasses.replace(cfg, quantization=mode)
    src = nnx.to_pure_dict(params)
    dtype = next(x.dtype for x in jax.tree.leaves(src) if jnp.issubdtype(x.dtype, jnp.floating))
    graphdef, abstract = abstract_model(cfg, dtype)

    def fill(want: dict, have: dict, path: tuple[str, ...]) -> dict:
        out = {}
        for key, leaf in want.items():
            if isinstance(leaf, dict):
                out[key] = fill(leaf, have[key], (*path, key))
            elif key.endswith(SCALE_SUFFIX):
                continue
            elif leaf.dtype in (jnp.int8, jnp.uint8):
                q, scale = quantize_weight(np.asarray(jax.device_get(have[key]), np.float32),
                                           stacked_in_axes((*path, key)), mode,
                                           linear=bool(path))
                out[key], out[key + SCALE_SUFFIX] = jnp.asarray(q), jnp.asarray(scale)
            else:
                out[key] = have[key]
        return out

    state = jax.tree.map(lambda x: x, abstract)
    nnx.replace_by_pure_dict(state, fill(nnx.to_pure_dict(abstract), src, ()))
    return cfg, graphdef, state


__all__ = ["quantize_state"]
