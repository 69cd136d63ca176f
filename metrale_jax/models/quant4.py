"""int4 weight-only quantization: 4-bit codes in blocks of 32 inputs, each block with its own
float16 scale and minimum (llama.cpp's Q4_1 form).

A linear weight `w` of shape `[in..., out...]` (the [in, out] layout of `models/layers.py`;
its K = prod(in) inputs flattened) is stored output-major, as GGUF stores it:

    q  [out..., K / 2]      uint8, two codes 0..15 a byte
    dm [out..., K / 32, 2]  float16, each block's (d, m):  w[..., 32b + i] = d * code + m

Within block b, byte j (0..15) holds input 32b + j in its low nibble and 32b + 16 + j in its
high one (Q4_1's order). Quantizing: `m = min`, `d = (max - min) / 15` over the block, both
rounded to float16 first, then `code = round((w - m) / d)` clipped to 0..15, so
`|w - (d * code + m)| <= d / 2` plus float16's rounding of m. A block of llama.cpp Q4_1
values (dequantized) comes back exactly: its minimum is m and its maximum m + 15 d.

Per weight that is 4 bits and 1 bit of scales (5 bits: about a sixth of float32's bytes,
five eighths of int8's). Mode "int4" (`ModelConfig.quantization`) stores the linear
layers so and the embedding and LM head int8 per row (as "int8-all": `models/quant.py`), as
llama.cpp's Q4 files keep those at 8 bits; K must divide by 32.

Products: on a single CPU device a float32 product of at most `KERNEL_MAX_ROWS_INT4` (128)
rows runs the C++ kernel (`kernels/int4_matmul.py`), which reads each packed byte once per
call and quantizes the activations per block to int8 for integer dot products (as llama.cpp
does for its Q4 types); elsewhere (longer prefill chunks, meshes, TPU and GPU) XLA
dequantizes the weight and runs its float dot, activations in the compute dtype.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from metrale_jax.config import INT4_BLOCK as BLOCK
from metrale_jax.config import check_int4_inputs as check_inputs
from metrale_jax.kernels.int4_matmul import int4_matmul
from metrale_jax.models.quant_base import SCALE_SUFFIX, kernel_serves


def _split_inputs(w: Any, in_axes: tuple[int, ...]) -> Any:
    """`w` with its `in_axes` moved last and flattened into K: `[other axes..., K]`."""
    xp = np if isinstance(w, np.ndarray) else jnp
    rest = [a for a in range(w.ndim) if a not in in_axes]
    moved = xp.transpose(w, (*rest, *in_axes))
    return moved.reshape(*moved.shape[:len(rest)], -1)


def quantize4(w: Any, in_axes: tuple[int, ...]) -> tuple[Any, Any]:
    """`w` (numpy, or a jax array) -> `(q uint8 [other..., K / 2], dm float16
    [other..., K / 32, 2])`, where `other` are w's axes not in `in_axes`, in order, and K the
    product of the `in_axes` sizes (flattened in their order). See the module docstring."""
    xp = np if isinstance(w, np.ndarray) else jnp
    flat = _split_inputs(w.astype(xp.float32), in_axes)
    k = flat.shape[-1]
    check_inputs(k)
    blocks = flat.reshape(*flat.shape[:-1], k // BLOCK, BLOCK)
    lo, hi = blocks.min(axis=-1), blocks.max(axis=-1)
    m = lo.astype(xp.float16)
    d = ((hi - lo) / 15.0).astype(xp.float16)
    d32, m32 = d.astype(xp.float32)[..., None], m.astype(xp.float32)[..., None]
    safe = xp.where(d32 > 0, d32, 1.0)
    codes = xp.clip(xp.round((blocks - m32) / safe), 0, 15).astype(xp.uint8)
    codes = xp.where(d32 > 0, codes, 0).astype(xp.uint8)
    half = BLOCK // 2
    packed = codes[..., :half] | (codes[..., half:] << 4)
    q = packed.reshape(*flat.shape[:-1], k // 2).astype(xp.uint8)
    return q, xp.stack([d, m], axis=-1)


def dequantize4(q: Any, dm: Any, dtype: Any = np.float32) -> Any:
    """The weight `[other..., K]` (output-major, inputs flattened) of `quantize4`'s `(q, dm)`,
    in `dtype` (computed in float32)."""
    xp = np if isinstance(q, np.ndarray) else jnp
    blocks = q.reshape(*q.shape[:-1], -1, BLOCK // 2)
    codes = xp.concatenate([blocks & 0xF, blocks >> 4], axis=-1).astype(xp.float32)
    dm32 = dm.astype(xp.float32)
    w = codes * dm32[..., 0:1] + dm32[..., 1:2]
    return w.reshape(*q.shape[:-1], -1).astype(dtype)


def int4_product(x: jax.Array, n_in: int, q: jax.Array, dm: jax.Array) -> jax.Array:
    """`x [..., in...]` (its last `n_in` axes the inputs, K in all) times the int4 weight
    `(q [out..., K / 2], dm)` -> `[..., out...]` in x's dtype. On a single CPU device a
    float32 x of few rows runs the kernel; otherwise XLA's dot on the dequantized weight."""
    lead = x.shape[:x.ndim - n_in]
    k = math.prod(x.shape[x.ndim - n_in:])
    out = q.shape[:-1]
    xf = x.reshape(*lead, k)
    qf, dmf = q.reshape(-1, k // 2), dm.reshape(-1, k // BLOCK, 2)
    if kernel_serves(x, n_in, "int4"):
        y = int4_matmul(xf.reshape(-1, k), qf, dmf).astype(x.dtype)
    else:
        w = dequantize4(qf, dmf, x.dtype)
        y = jnp.einsum("...k,nk->...n", xf, w)
    return y.reshape(*lead, *out)


def is_block_scale(path: tuple, x: Any) -> bool:
    """Whether the param `x` at pytree `path` is an int4 weight's block scales (float16,
    named `<weight>_scale`), which keep their dtype whatever the compute dtype."""
    last = path[-1] if path else None
    name = getattr(last, "key", getattr(last, "name", None))
    if name == "value" and len(path) > 1:  # an nnx variable's value
        name = getattr(path[-2], "key", getattr(path[-2], "name", None))
    return x.dtype == jnp.float16 and str(name).endswith(SCALE_SUFFIX)


__all__ = ["BLOCK", "check_inputs", "dequantize4", "int4_product", "is_block_scale",
           "quantize4"]
