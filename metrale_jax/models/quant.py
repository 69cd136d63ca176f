"""int8 weight-only quantization: int8 weights with per-output-channel float scales.

A quantized weight `w` of a linear layer is stored as `q: int8` with `w`'s shape and `scale`,
whose shape is `w`'s output axes: the weights use the [in, out] layout (`models/layers.py`),
so the first `n_in` axes are the input ones and `scale = max|w| / 127` over them.
Symmetric, round to nearest: `q = round(w / scale)` in [-127, 127], and
`|w - q * scale| <= scale / 2` per element. Shapes, with the input axes first:

    q_proj [E, H, D] -> scale [H, D]      o_proj [H, D, E] -> scale [E]   (n_in = 2)
    gate / up [E, F] -> scale [F]         down [F, E] -> scale [E]
    embed [V, E] -> scale [V] (per row)   lm_head [E, V] -> scale [V]

Activations stay in the compute dtype: `(x @ q.astype(x.dtype)) * scale` keeps the dot in
float (XLA fuses the convert into the dot on GPU and TPU, which then read half (bfloat16) or a
quarter (float32) of the weight bytes); the scale applies to the dot's output, since it is
constant along the reduced axes.

On XLA:CPU this form decodes about 5x slower than float32 (the convert fused into the dot
takes it off the fast Eigen path; a weight converted behind an optimization barrier is slower
still): on CPU int8 saves memory, not time (README, "int8 weights").

Modes (`ModelConfig.quantization`): "int8" quantizes the linear layers (attention q/k/v/o and
the MLP); "int8-all" also the embedding and the LM head. The default keeps embed/head float:
the head's error lands directly on every logit (and, tied, the embedding's on every input),
where the layers' errors are damped by the residual stream and the norms; measured on the
default model, int8-all's max logit error is 0.100 against int8's 0.086 (bench/quantization.py).
The head is a large share of a small model's weights (SmolLM2-135M: 28M of 135M, read whole
every token), so "int8-all" is the choice where weight bytes matter most.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from metrale_jax.config import QUANTIZATIONS

SCALE_SUFFIX = "_scale"
"""A quantized weight `name`'s scale is the param `name + SCALE_SUFFIX` beside it."""

# Per module: quantized weight name -> the number of its leading input axes.
ATTENTION_LINEAR: dict[str, int] = {"q_proj": 1, "k_proj": 1, "v_proj": 1, "o_proj": 2}
MLP_LINEAR: dict[str, int] = {"gate": 1, "up": 1, "down": 1}


def check_quantization(value: str | None) -> str | None:
    """`value` if it is None or one of `QUANTIZATIONS`, else raises `InvalidParameterError`."""
    if value is not None and value not in QUANTIZATIONS:
        from metrale_jax.errors import InvalidParameterError
        raise InvalidParameterError(
            f"quantization must be one of {QUANTIZATIONS} or None, got {value!r}",
            param="quantization")
    return value


def quantizes_embeddings(mode: str | None) -> bool:
    """Whether `mode` quantizes the embedding and the LM head too."""
    return mode == "int8-all"


def quantize(w: Any, in_axes: tuple[int, ...]) -> tuple[Any, Any]:
    """`w` (numpy on the host, or a jax array) -> `(q int8 [w.shape], scale float32)`, the
    scale over `in_axes` removed (`scale.shape` = w's other axes). A channel of zeros gets
    scale 0 (and q 0)."""
    xp = np if isinstance(w, np.ndarray) else jnp
    w32 = w.astype(xp.float32)
    scale = xp.max(xp.abs(w32), axis=in_axes, keepdims=True) / 127.0
    safe = xp.where(scale > 0, scale, 1.0)
    q = xp.clip(xp.round(w32 / safe), -127, 127).astype(xp.int8)
    return q, xp.squeeze(scale, axis=in_axes).astype(xp.float32)


def dequantize(q: Any, scale: Any, in_axes: tuple[int, ...]) -> Any:
    """The float32 weight `q * scale` (scale broadcast back over `in_axes`)."""
    xp = np if isinstance(q, np.ndarray) else jnp
    return q.astype(xp.float32) * xp.expand_dims(scale, in_axes)


def qmatmul(x: jax.Array, w: jax.Array, scale: jax.Array | None) -> jax.Array:
    """`x [..., in] @ w [in, out]` for a float (scale None) or int8 `w` with `scale [out]`;
    the result is in x's dtype."""
    if scale is None:
        return x @ w
    return (x @ w.astype(x.dtype)) * scale.astype(x.dtype)


def qeinsum(spec: str, x: jax.Array, w: jax.Array, scale: jax.Array | None) -> jax.Array:
    """`jnp.einsum(spec, x, w)` for a float or int8 `w` whose scale matches the trailing axes
    of the result (e.g. "bte,ehd->bthd" with scale [H, D])."""
    if scale is None:
        return jnp.einsum(spec, x, w)
    return jnp.einsum(spec, x, w.astype(x.dtype)) * scale.astype(x.dtype)


def stacked_in_axes(path: tuple[str, ...]) -> tuple[int, ...]:
    """The input axes of the `Transformer` param at `path` (its pure-dict keys, layers stacked
    `[L, ...]`): blocks' linear weights after the L axis, embed [V, E] its E, lm_head [E, V]
    its E."""
    if path == ("embed",):
        return (1,)
    if path == ("lm_head",):
        return (0,)
    n_in = (ATTENTION_LINEAR if path[-2] == "attn" else MLP_LINEAR)[path[-1]]
    return tuple(range(1, 1 + n_in))


def scale_axes(axes: dict, linear: dict[str, int]) -> dict:
    """A module's logical-axes table with each quantized weight's scale added: the scale takes
    the output axes of its weight (e.g. q_proj ("embed", "heads", "head_dim") -> q_proj_scale
    ("heads", "head_dim")), so it shards like the weight's output."""
    out = dict(axes)
    for name, n_in in linear.items():
        out[name + SCALE_SUFFIX] = tuple(axes[name][n_in:])
    return out


__all__ = ["ATTENTION_LINEAR", "MLP_LINEAR", "QUANTIZATIONS", "SCALE_SUFFIX",
           "check_quantization", "dequantize", "qeinsum", "qmatmul", "quantize",
           "quantizes_embeddings", "scale_axes", "stacked_in_axes"]
