"""Logits of whole sequences through the production path, for the tests and benchmarks that
compare a model against transformers or against another form of itself: each row prefilled
through `models/ragged.py`'s layers over a paged cache (`sequence_logits`), as the engine
prefills a prompt."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from flax import nnx

from metrale_jax.models.ragged import sequence_logits
from metrale_jax.models.unrolled import LayerGraph, LayerParams, split_layers


def rows_logits(graph: LayerGraph, params: LayerParams, tokens, *, chunk: int | None = None,
                page_size: int = 16, cache_dtype=None) -> np.ndarray:
    """tokens `[B, T]` int -> logits `[B, T, V]` float32, each row on its own, in chunks of
    `chunk` tokens (default: all T in one); the cache in `cache_dtype` (default: the
    embeddings' dtype)."""
    tokens = np.asarray(tokens)
    if cache_dtype is None:
        cache_dtype = params.outer["embed"][...].dtype
        cache_dtype = cache_dtype if jnp.issubdtype(cache_dtype, jnp.floating) else jnp.float32
    chunk = chunk or tokens.shape[1]
    return np.stack([np.asarray(sequence_logits(graph, params, [int(t) for t in row],
                                                page_size=page_size, cache_dtype=cache_dtype,
                                                chunk=chunk))
                     for row in tokens])


def stacked_logits(graphdef: nnx.GraphDef, params: nnx.State, tokens, **kw) -> np.ndarray:
    """`rows_logits` of a model given as its graphdef and stacked params (a checkpoint's)."""
    graph, layers = split_layers(graphdef, params)
    return rows_logits(graph, layers, tokens, **kw)
