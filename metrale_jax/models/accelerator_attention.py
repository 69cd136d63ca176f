"""JAX's Pallas TPU kernel behind `paged_attention.ragged_paged_attention`'s contract: its
preconditions, checked before the call and at load time, and its `shard_map` over kv heads.

The kernel is `jax.experimental.pallas.ops.tpu.ragged_paged_attention.ragged_paged_attention`
(JAX's source, never copied here). It reads our pool layout as it is (`[N, ps, 2K, D]`, key
head j at 2j and value head j at 2j + 1; `models/paged_attention.py`), so no pool is copied.
What it needs, read from its validation code and its body (JAX 0.10.2), each a reason
`tpu_kernel_problems` names:

- a float pool (float32 or bfloat16) and queries of a float dtype: our int8 pool
  (`[N, ps, 2K, D + 4]`, scales in the rows) is not its layout;
- `num_q_heads % num_kv_heads == 0` (GQA groups of whole query heads);
- head_dim a multiple of 128: its softmax statistics are 128 lanes wide and are broadcast
  over head_dim (`broadcast_to_shape` asserts `head_dim % 128 == 0` while tracing), so
  head_dim 64 (SmolLM2, Llama-3.2-1B) does not trace;
- the combined kv heads one device holds (2K, or 2K / model under a mesh) "XLA fully tiled"
  for the pool's dtype: divisible by its packing (1 for float32, 2 for bfloat16) and the
  quotient 1, 2, 4, 8 or a multiple of 8 (`get_min_heads_per_blk`): 2K = 6 (K = 3) is not;
- a TPU of generation 4 or later (its tuned block sizes refuse v2 and v3);
- at call time: `sliding_window > 0`, `soft_cap != 0`, int32 metadata (cast here), and
  pages per block <= pages per sequence (chosen here so).

Where a model does not fit, `paged_attention.ragged_paged_attention` runs the XLA path on
TPU too and logs why once; `attention_path`, called by the engine at load, logs the same
decision before the first step. `tpu_ragged_paged_attention` itself (a direct call) raises
ValueError naming the model's value and what the kernel needs.

Under a mesh the kernel's `pallas_call` has no partitioning rule: `tpu_ragged_paged_attention`
wraps it in `jax.shard_map` over the "model" axis, query heads `[T, H, D]` on axis 1 and the
pool's interleaved kv heads on axis 2 (`engine/sharding.py` shards the pool there when K
divides by "model": each device then holds K/model whole key/value pairs and the matching
H/model query heads); the step's metadata is replicated. Where K does not divide, the pool is
replicated and so is the kernel's work.

`METRALE_TPU_KERNEL=0` turns the kernel off (the XLA path runs on TPU as elsewhere).
"""

from __future__ import annotations

import functools
import logging
import os
import re
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

log = logging.getLogger(__name__)

__all__ = [
    "TPU_KERNEL_ENV",
    "attention_path",
    "check_tpu_kernel",
    "fits_tpu_kernel",
    "kernel_mesh",
    "set_kernel_mesh",
    "tpu_generation",
    "tpu_kernel_problems",
    "tpu_ragged_paged_attention",
    "use_tpu_kernel",
]

TPU_KERNEL_ENV = "METRALE_TPU_KERNEL"
MODEL_AXIS = "model"
_FLOATS = (jnp.float32, jnp.bfloat16)
_mesh: Mesh | None = None


@functools.cache
def _tpu_kernel() -> tuple[Any, str]:
    """(JAX's kernel, "") where this JAX ships it, else (None, why)."""
    try:
        from jax.experimental.pallas.ops.tpu.ragged_paged_attention import (
            ragged_paged_attention,
        )
    except ImportError as e:
        return None, (f"JAX {jax.__version__} has no jax.experimental.pallas.ops.tpu."
                      f"ragged_paged_attention ({e})")
    return ragged_paged_attention, ""


def use_tpu_kernel() -> bool:
    """Whether the ragged step goes to JAX's Pallas TPU kernel: on a TPU backend, unless
    `METRALE_TPU_KERNEL=0`. A model that does not fit the kernel (`tpu_kernel_problems`) still
    runs the XLA path there."""
    return jax.default_backend() == "tpu" and os.environ.get(TPU_KERNEL_ENV, "1") != "0"


def set_kernel_mesh(mesh: Mesh | None) -> None:
    """The mesh the kernel's `shard_map` splits over (the engine's, set at load by
    `attention_path`; None: one device). One per process: the last engine loaded."""
    global _mesh
    _mesh = mesh


def kernel_mesh() -> Mesh | None:
    """The mesh set by `set_kernel_mesh` (None: none)."""
    return _mesh


def _model_shards(mesh: Mesh | None, num_kv_heads: int) -> int:
    """How many ways the kv heads split on `mesh`'s "model" axis (1: replicated)."""
    m = dict(mesh.shape).get(MODEL_AXIS, 1) if mesh is not None else 1
    return m if m > 1 and num_kv_heads % m == 0 else 1


def tpu_generation(device_kind: str) -> int | None:
    """The TPU generation in a device kind ("TPU v4" -> 4, "TPU v5 lite" -> 5, "TPU v6e" -> 6,
    "TPU7x" -> 7); None when the kind names no TPU generation."""
    m = re.search(r"tpu\s*v?(\d+)", device_kind.lower())
    return int(m.group(1)) if m else None


def _fully_tiled(x: int, packing: int) -> bool:
    """The kernel's `can_be_xla_fully_tiled`: x divisible by packing, the quotient 1, 2, 4, 8
    or a multiple of 8."""
    if x % packing:
        return False
    x //= packing
    return x in (1, 2, 4, 8) or x % 8 == 0


def tpu_kernel_problems(num_q_heads: int, num_kv_heads: int, head_dim: int, page_size: int,
                        q_dtype: Any, kv_dtype: Any, *, shards: int = 1,
                        device_kind: str | None = None) -> list[str]:
    """Why JAX's TPU kernel cannot take this model and cache (empty: it can), one sentence
    each, naming the model's value and what the kernel needs.

    num_q_heads H, num_kv_heads K, head_dim D, page_size ps: the model's and the cache's;
    q_dtype, kv_dtype: the queries' and the pool's dtypes (the int8 pool's dtype is int8);
    shards: how many ways the kv heads split over the mesh's "model" axis (each device's
    kernel sees 2K / shards combined heads); device_kind: the TPU's, to check its
    generation (None: not checked)."""
    out = []
    q_dtype, kv_dtype = jnp.dtype(q_dtype), jnp.dtype(kv_dtype)
    if kv_dtype not in _FLOATS:
        out.append(f"the KV cache is {kv_dtype}: the kernel takes float32 or bfloat16 pools "
                   "only (an int8 cache keeps its scales in the rows, not the kernel's layout)")
    if q_dtype not in _FLOATS:
        out.append(f"the queries are {q_dtype}: the kernel takes float32 or bfloat16")
    if num_kv_heads <= 0 or num_q_heads % num_kv_heads:
        out.append(f"num_heads={num_q_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    if head_dim % 128:
        out.append(f"head_dim={head_dim}: the kernel needs a multiple of 128 (its softmax "
                   "statistics are 128 lanes wide, broadcast over head_dim)")
    if page_size <= 0:
        out.append(f"page_size={page_size} must be positive")
    if shards > 1 and num_kv_heads % shards:
        out.append(f"num_kv_heads={num_kv_heads} does not split over model={shards}")
    elif num_kv_heads > 0 and kv_dtype in _FLOATS:
        combined = 2 * num_kv_heads // shards
        packing = 4 // kv_dtype.itemsize
        if not _fully_tiled(combined, packing):
            per = f" per device (model={shards})" if shards > 1 else ""
            need = "" if packing == 1 else f"a multiple of {packing} whose quotient is "
            out.append(f"{combined} combined kv heads (2 x num_kv_heads){per} in {kv_dtype}: "
                       f"the kernel needs {need}1, 2, 4, 8 or a multiple of 8 (XLA fully "
                       "tiled)")
    if device_kind is not None:
        gen = tpu_generation(device_kind)
        if gen is not None and gen < 4:
            out.append(f"device {device_kind!r}: the kernel needs TPU v4 or later")
    return out


def check_tpu_kernel(*args, **kwargs) -> None:
    """`tpu_kernel_problems(*args, **kwargs)`, raised as one ValueError when any."""
    problems = tpu_kernel_problems(*args, **kwargs)
    if problems:
        raise ValueError("JAX's TPU ragged paged attention kernel cannot take this model: "
                         + "; ".join(problems))


@functools.cache
def _log_fallback_once(problems: tuple[str, ...]) -> None:
    """Logs, once per distinct set of reasons, that the XLA path runs instead of the kernel."""
    log.warning("TPU kernel off for this model, the XLA attention path runs: %s",
                "; ".join(problems))


def attention_path(num_q_heads: int, num_kv_heads: int, head_dim: int, page_size: int,
                   q_dtype: Any, kv_dtype: Any, mesh: Mesh | None = None) -> str:
    """The attention path a model's steps take, decided and logged at load: "tpu-kernel"
    (JAX's Pallas kernel over the whole ragged step) or "xla" (the decode and chunk tiers of
    `models/paged_attention.py`, the C++ kernels on a single-device float32 CPU). On TPU it
    records `mesh` for the kernel's `shard_map` and logs why a model that does not fit the
    kernel takes the XLA path (`tpu_kernel_problems`). Arguments as `tpu_kernel_problems`."""
    if not use_tpu_kernel():
        return "xla"
    set_kernel_mesh(mesh)
    problems = tpu_kernel_problems(
        num_q_heads, num_kv_heads, head_dim, page_size, q_dtype, kv_dtype,
        shards=_model_shards(mesh, num_kv_heads), device_kind=jax.devices()[0].device_kind)
    if _tpu_kernel()[0] is None:
        problems.append(_tpu_kernel()[1])
    if problems:
        _log_fallback_once(tuple(problems))
        return "xla"
    log.info("attention: JAX's Pallas TPU ragged paged attention kernel")
    return "tpu-kernel"


def fits_tpu_kernel(q: jax.Array, kv_pages: jax.Array) -> bool:
    """Whether these queries `[T, H, D]` and pool `[N, ps, 2K, D]` fit the kernel on the mesh
    of `kernel_mesh()`; when not, logs why once (the caller runs the XLA path)."""
    K = kv_pages.shape[2] // 2
    problems = tpu_kernel_problems(q.shape[1], K, q.shape[2], kv_pages.shape[1], q.dtype,
                                   kv_pages.dtype, shards=_model_shards(kernel_mesh(), K),
                                   device_kind=jax.devices()[0].device_kind)
    if _tpu_kernel()[0] is None:
        problems.append(_tpu_kernel()[1])
    if kv_pages.shape[-1] != q.shape[-1] and not problems:  # (int8 rows: D + 4, named)
        problems.append(f"the pool's rows are {kv_pages.shape[-1]} wide, the queries' "
                        f"head_dim {q.shape[-1]}")
    if problems:
        _log_fallback_once(tuple(problems))
    return not problems


def tpu_ragged_paged_attention(q: jax.Array, kv_pages: jax.Array, kv_lens: jax.Array,
                               page_indices: jax.Array, cu_q_lens: jax.Array,
                               num_seqs: jax.Array, *, sm_scale: float,
                               sliding_window: int | None = None,
                               soft_cap: float | None = None, mask_value: float | None = None,
                               mesh: Mesh | None = None, interpret: Any = None,
                               num_kv_pages_per_block: int | None = None,
                               num_queries_per_block: int | None = None,
                               kernel: Any = None) -> jax.Array:
    """JAX's TPU kernel on `ragged_paged_attention`'s contract, its preconditions checked
    first (ValueError naming what does not fit), under `shard_map` over kv heads on `mesh`.

    q: `[T, H, D]`; kv_pages: `[N, ps, 2K, D]` float32 or bfloat16; kv_lens: `[S]`;
    page_indices: `[S, PPS]`; cu_q_lens: `[S + 1]`; num_seqs: `[1]` (any int dtype: cast to
    int32). Returns `[T, H, D]` in q's dtype (tokens past `cu_q_lens[num_seqs]`: meaningless).

    mesh: split over its "model" axis when K divides by it (else the kernel runs on every
    device over all heads); None: no `shard_map`. interpret: None runs the compiled kernel
    (TPU only); otherwise the pallas_call runs in Pallas interpret mode on the CPU under
    `pltpu.force_tpu_interpret_mode(interpret)` (a `pltpu.InterpretParams()`: TPU interpret
    mode; True: the generic HLO interpreter), with explicit block sizes (the tuned ones need a
    TPU). num_kv_pages_per_block, num_queries_per_block: the kernel's blocks (None: tuned on
    TPU, 4 pages and 8 queries interpreted; capped at PPS and T). kernel: the function to
    call with those arguments (None: JAX's kernel; a test passes the XLA path to check the
    `shard_map` alone).
    """
    T, H, D = q.shape
    _, ps, K2, Dk = kv_pages.shape
    K = K2 // 2
    shards = _model_shards(mesh, K)
    problems = tpu_kernel_problems(H, K, D, ps, q.dtype, kv_pages.dtype, shards=shards)
    if K2 % 2 or Dk != D:
        problems.append(f"the pool {kv_pages.shape} is not [N, ps, 2K, D={D}]")
    if sliding_window is not None and sliding_window <= 0:
        problems.append(f"sliding_window={sliding_window} must be positive")
    if soft_cap is not None and soft_cap == 0.0:
        problems.append("soft_cap=0.0: the kernel needs None or a nonzero cap")
    if problems:
        raise ValueError("JAX's TPU ragged paged attention kernel cannot take this call: "
                         + "; ".join(problems))
    i32 = jnp.int32
    meta = (kv_lens.astype(i32), page_indices.astype(i32), cu_q_lens.astype(i32),
            jnp.asarray(num_seqs, i32).reshape(1))
    PPS = page_indices.shape[1]
    if interpret is not None:
        num_kv_pages_per_block = num_kv_pages_per_block or 4
        num_queries_per_block = num_queries_per_block or 8
    blocks = {}
    if num_kv_pages_per_block is not None and num_queries_per_block is not None:
        blocks = dict(num_kv_pages_per_block=min(num_kv_pages_per_block, PPS),
                      num_queries_per_block=min(num_queries_per_block, T))
    opts = dict(sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
                mask_value=mask_value)
    if kernel is None:
        kernel, why = _tpu_kernel()
        if kernel is None:
            raise NotImplementedError(why)
        opts.update(blocks)
    force = None
    if interpret is not None:
        from jax.experimental.pallas import tpu as pltpu
        force = getattr(pltpu, "force_tpu_interpret_mode", None)
        if force is None:
            raise NotImplementedError(f"JAX {jax.__version__} has no jax.experimental.pallas."
                                      "tpu.force_tpu_interpret_mode: no interpret mode here")

    def call(q, kv_pages, *meta):
        if force is None:
            return kernel(q, kv_pages, *meta, **opts)
        with force(interpret):
            return kernel(q, kv_pages, *meta, **opts)

    if mesh is None:
        return call(q, kv_pages, *meta)
    heads = MODEL_AXIS if shards > 1 else None
    return jax.shard_map(
        call, mesh=mesh,
        in_specs=(PartitionSpec(None, heads, None), PartitionSpec(None, None, heads, None),
                  PartitionSpec(), PartitionSpec(), PartitionSpec(), PartitionSpec()),
        out_specs=PartitionSpec(None, heads, None), check_vma=False)(q, kv_pages, *meta)
