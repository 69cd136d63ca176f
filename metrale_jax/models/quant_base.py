"""What the int8 and int4 weight formats share (`models/quant.py`, `models/quant4.py`): the
name of a quantized weight's scale param, and when a CPU kernel serves a product.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from metrale_jax.kernels import int4_matmul, int8_matmul

SCALE_SUFFIX = "_scale"
"""A quantized weight `name`'s scale is the param `name + SCALE_SUFFIX` beside it."""


KERNEL_MAX_ROWS = 48
"""The CPU int8 kernel (`kernels/int8_matmul.py`) serves a product of at most this many rows
of x (decode, verify, small prefill chunks); above it XLA's form (a convert, then its float32
dot) is faster: measured on the default model's forward, the kernel wins up to 48 tokens and
loses from 64 on (`models/quant.py`'s docstring)."""


KERNEL_MAX_ROWS_INT4 = 128
"""The CPU int4 kernel (`kernels/int4_matmul.py`) serves a product of at most this many rows;
XLA's form (the dequantized weight's float32 dot) wins above. Measured on 10 layers of the
default model's products (`bench/weight_kernels.py`, ms, kernel vs XLA's form): 16 rows 9.2
vs 40.5, 64 52 vs 72, 96 48 vs 59, 128 67 vs 74, 256 129 vs 99."""


def kernel_serves(x: jax.Array, n_in: int, kind: str = "int8") -> bool:
    """Whether a CPU kernel (`kind` "int8": `kernels/int8_matmul.py`, "int4":
    `kernels/int4_matmul.py`) serves a product of `x`'s last `n_in` axes: float32 x of at
    most `KERNEL_MAX_ROWS` rows (int4: `KERNEL_MAX_ROWS_INT4`) on a single-device CPU backend
    (a mesh keeps XLA's form, which its SPMD partitioner can split), and the kernel is enabled
    and built."""
    if x.dtype != jnp.float32 or jax.default_backend() != "cpu" or jax.device_count() != 1:
        return False
    limit = KERNEL_MAX_ROWS_INT4 if kind == "int4" else KERNEL_MAX_ROWS
    if math.prod(x.shape[:x.ndim - n_in]) > limit:
        return False
    if kind == "int4":
        return int4_matmul.available()
    return int8_matmul.available()


__all__ = ["KERNEL_MAX_ROWS", "KERNEL_MAX_ROWS_INT4", "SCALE_SUFFIX", "kernel_serves"]
