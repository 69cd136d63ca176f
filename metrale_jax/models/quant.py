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

On XLA:CPU that form decodes about 5x slower than float32: for a product of few rows, the
int8 -> float32 convert of the whole weight costs as much as the memory-bound product itself.
So on a single CPU device a float32 product of at most `KERNEL_MAX_ROWS` rows (decode,
verify, small prefill chunks) runs a C++ XLA FFI kernel instead
(`metrale_jax/kernels/int8_matmul.py`: built with the system g++ on first use, cached per
user; `METRALE_INT8_KERNEL=0` or no compiler keeps the XLA form). It reads each int8 weight
byte once per call: on a 30-layer 576x1536 matvec stack, 1.7 ms against float32's 8.3 ms
and the XLA int8 form's 67 ms (one row; four rows: 3.1, 14.2 and 63 ms), and the default
model decodes int8 about 2x faster than float32 (docs/quantization.md, "int8 weights").

Larger products (prefill) keep XLA's form, which jaxlib 0.10's XLA:CPU compiles to a
separate convert of the weight to float32 (a loop fusion, not fused into the dot) followed by
its float32 (YNNPACK) dot: the convert's K*N elements are small next to an M >= 64 product,
so int8 prefill runs as fast as float32 (the default model, a 500-token prompt through the
engine: float32 1.74 s, int8 1.60 s, int8-all 1.71 s to the first token, best of 5). A
custom call that dequantizes into the dot's float32 operand was measured and dropped: it is
that same structure, and was slower than XLA's own convert at every size tried (M 32-512).
The cut-off was measured on the model's forward (no cache, T tokens; the kernel vs XLA's
form, ms, best of 9 alternating runs on a shared 2-core machine): T=16 69 vs 89, 32 104 vs
118, 48 148 vs 170, 64 198 vs 179, 128 408 vs 330. A mesh keeps XLA's form too (XLA's SPMD
partitioner has no rule for the custom call). `qmatmul` and the `qeinsum` specs of
`models/layers.py` map onto the kernel's two weight layouts, [in, out] and [out, in] (the
tied LM head).

Modes (`ModelConfig.quantization`): "int8" quantizes the linear layers (attention q/k/v/o and
the MLP); "int8-all" also the embedding and the LM head. The default keeps embed/head float:
the head's error lands directly on every logit (and, tied, the embedding's on every input),
where the layers' errors are damped by the residual stream and the norms; measured on the
default model, int8-all's max logit error is 0.100 against int8's 0.086 (bench/quantization.py).
The head is a large share of a small model's weights (SmolLM2-135M: 28M of 135M, read whole
every token), so "int8-all" is the choice where weight bytes matter most. Mode "int4" stores
the linear layers 4-bit (`models/quant4.py`, its own kernel) and the embedding and LM head
int8 as "int8-all" does; `qmatmul` / `qeinsum` tell an int4 weight by its dtype (uint8).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from metrale_jax.config import QUANTIZATIONS
from metrale_jax.errors import InvalidParameterError
from metrale_jax.kernels.int8_matmul import int8_matmul
from metrale_jax.models.quant4 import int4_product, quantize4
from metrale_jax.models.quant_base import (
    KERNEL_MAX_ROWS,
    KERNEL_MAX_ROWS_INT4,
    SCALE_SUFFIX,
    kernel_serves,
)

# Per module: quantized weight name -> the number of its leading input axes.
ATTENTION_LINEAR: dict[str, int] = {"q_proj": 1, "k_proj": 1, "v_proj": 1, "o_proj": 2}
MLP_LINEAR: dict[str, int] = {"gate": 1, "up": 1, "down": 1}


def check_quantization(value: str | None) -> str | None:
    """`value` if it is None or one of `QUANTIZATIONS`, else raises `InvalidParameterError`."""
    if value is not None and value not in QUANTIZATIONS:
        raise InvalidParameterError(
            f"quantization must be one of {QUANTIZATIONS} or None, got {value!r}",
            param="quantization")
    return value


def quantizes_embeddings(mode: str | None) -> bool:
    """Whether `mode` quantizes the embedding and the LM head too (int8, per row)."""
    return mode in ("int8-all", "int4")


def quantize_weight(w: Any, in_axes: tuple[int, ...], mode: str | None,
                    linear: bool = True) -> tuple[Any, Any]:
    """`(stored weight, scale)` of the float `w` (numpy or jax; its `in_axes` the inputs) in
    `mode`: int8 and its per-output-channel scale (`quantize`), or for a linear layer of
    mode "int4" the packed codes and block scales (`models/quant4.py`). `linear` False: the
    embedding / LM head, int8 in every mode."""
    if mode == "int4" and linear:
        return quantize4(w, in_axes)
    return quantize(w, in_axes)


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


def _kernel_matmul(x: jax.Array, n_in: int, w: jax.Array, scale: jax.Array,
                   transposed: bool) -> jax.Array:
    """The kernel's `(x @ w) * scale` over x's last `n_in` axes: w [in..., out...] (or, if
    `transposed`, w [out, in] with one input axis); the result [x's other axes..., out...]."""
    lead = x.shape[:x.ndim - n_in]
    k = math.prod(x.shape[x.ndim - n_in:])
    out = w.shape[:1] if transposed else w.shape[n_in:]
    q = w.reshape(-1, k) if transposed else w.reshape(k, -1)
    y = int8_matmul(x.reshape(-1, k), q, scale.reshape(-1), transposed=transposed)
    return y.reshape(*lead, *out)


def qmatmul(x: jax.Array, w: jax.Array, scale: jax.Array | None) -> jax.Array:
    """`x [..., in] @ w [in, out]` for a float (scale None) or int8 `w` with `scale [out]`,
    or an int4 `w [out, in / 2]` with its `scale [out, in / 32, 2]` (`models/quant4.py`);
    the result is in x's dtype. On a single CPU device the product of few rows runs a C++
    kernel (`kernels/int8_matmul.py`, `kernels/int4_matmul.py`)."""
    if scale is None:
        return x @ w
    if w.dtype == jnp.uint8:
        return int4_product(x, 1, w, scale)
    if kernel_serves(x, 1):
        return _kernel_matmul(x, 1, w, scale, transposed=False)
    return (x @ w.astype(x.dtype)) * scale.astype(x.dtype)


def _einsum_layout(spec: str) -> tuple[int, bool] | None:
    """`(n_in, transposed)` if `spec` contracts x's last n_in axes with w's first ones, the
    output being x's other axes then w's (e.g. "bthd,hde->bte": (2, False)), or one axis with
    w's last, w [out, in] (e.g. "...e,ve->...v": (1, True)); None for any other spec."""
    lhs, out = spec.replace(" ", "").split("->")
    xs, ws = lhs.split(",")
    if xs.startswith("..."):
        if not out.startswith("..."):
            return None
        xs, out = xs[3:], out[3:]
    if "." in xs + ws + out:
        return None
    contracted = [c for c in xs if c not in out]
    n = len(contracted)
    if n == 0 or xs[len(xs) - n:] != "".join(contracted):
        return None
    batch, cs = xs[:len(xs) - n], xs[len(xs) - n:]
    if ws.startswith(cs) and out == batch + ws[n:]:
        return n, False
    if n == 1 and len(ws) == 2 and ws.endswith(cs) and out == batch + ws[0]:
        return 1, True
    return None


def qeinsum(spec: str, x: jax.Array, w: jax.Array, scale: jax.Array | None) -> jax.Array:
    """`jnp.einsum(spec, x, w)` for a float or int8 `w` whose scale matches the trailing axes
    of the result (e.g. "bte,ehd->bthd" with scale [H, D]), or an int4 `w` (stored
    `[out..., in / 2]`, `models/quant4.py`) for a spec `_einsum_layout` maps to [in, out].
    On a single CPU device the product of few rows runs a C++ kernel for those specs."""
    if scale is None:
        return jnp.einsum(spec, x, w)
    layout = _einsum_layout(spec)
    if w.dtype == jnp.uint8:
        if layout is None or layout[1]:
            raise ValueError(f"int4 weights take an [in, out] einsum, not {spec!r}")
        return int4_product(x, layout[0], w, scale)
    if layout is not None and kernel_serves(x, layout[0]):
        return _kernel_matmul(x, layout[0], w, scale, transposed=layout[1])
    return jnp.einsum(spec, x, w.astype(x.dtype)) * scale.astype(x.dtype)


def stacked_in_axes(path: tuple[str, ...]) -> tuple[int, ...]:
    """The input axes of the `Transformer` param at `path` (its pure-dict keys, layers stacked
    `[L, ...]`): blocks' linear weights after the L axis (a mixture of experts' `[L, X, in,
    out]`: axis 2), embed [V, E] its E, lm_head [E, V] its E."""
    if path == ("embed",):
        return (1,)
    if path == ("lm_head",):
        return (0,)
    if path[-2] == "moe":  # expert weights [L, X, in, out] (models/moe.py)
        return (2,)
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


__all__ = ["ATTENTION_LINEAR", "KERNEL_MAX_ROWS", "KERNEL_MAX_ROWS_INT4", "MLP_LINEAR",
           "QUANTIZATIONS", "SCALE_SUFFIX", "check_quantization", "dequantize", "kernel_serves",
           "qeinsum", "qmatmul", "quantize", "quantize_weight", "quantizes_embeddings",
           "scale_axes", "stacked_in_axes"]
