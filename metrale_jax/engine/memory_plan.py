"""Memory planning: the largest KV cache (slots B x length S) that fits beside the params.

Everything is per device, on the mesh the engine will use, and computed before anything is
allocated, from shapes only: the params' shards come from the same logical-axis rules that
place them (`engine/sharding.py`), so a replicated tensor (kv heads fewer than the `model`
axis, heads that do not divide it) is counted on every device. Per device:

    memory = params + KV cache + scratch + reserve (+ what is left)
    KV cache = (B / data) slots x S tokens x L layers x 2 (k, v) x K_dev x D x cache itemsize
               (int8: x (D + 4) bytes, each row's values and its float32 scale)
    scratch  = the largest prefill's temporaries (its own keys and values, attention scores
               over S + P, activations) + the decode logits and sampling temporaries
    reserve  = `reserve_fraction` of memory (XLA's workspace, fragmentation, runtime)

where K_dev is K / model when the kv heads shard over `model`, else K, and the params count
their compute dtype's bytes, except int8-quantized weights (`--quantization`): 1 byte each,
plus their float scales. `plan_memory` is a pure function of (ModelConfig, itemsizes, mesh
shape, memory bytes, requested B / S or None, quantization); `device_memory_bytes` reads the
memory from the devices (`memory_stats()["bytes_limit"]`) or takes `--memory-gb` where the
platform reports none (CPU).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from metrale_jax.config import ModelConfig
from metrale_jax.engine.sharding import format_mesh, param_specs, partition_spec, shard_shape
from metrale_jax.errors import InvalidParameterError, MemoryPlanError
from metrale_jax.models.kv_quant import stored_head_dim
from metrale_jax.models.transformer import abstract_model

GiB = 1 << 30
LENGTH_ALIGN = 128  # an automatic cache length is a multiple of this (when at least this)
DEFAULT_LEN = 4096  # the automatic cache length, when the model allows it
MAX_AUTO_SLOTS = 256  # automatic slots per data shard stop here; the cache grows longer instead
SAMPLING_COPIES = 4  # decode logits [B, V] float32 and the sampler's sorted/masked copies


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """A KV cache size and where each device's memory goes (all byte counts per device).

    mesh: (data, model); slots: B (a multiple of data); max_len: S;
    memory_bytes: the device memory (None: unknown, the plan was not checked);
    param_bytes: the device's params; token_bytes: KV cache bytes of one slot-token on the
    device holding the slot (the layers with paged caches); scratch_bytes, reserve_bytes: as
    the module docstring says; window_bytes: the rings of sliding-window layers
    (`models/window_cache.py`): every slot's, whatever max_len (0 without them).
    """

    mesh: tuple[int, int]
    slots: int
    max_len: int
    memory_bytes: int | None
    param_bytes: int
    token_bytes: int
    scratch_bytes: int
    reserve_bytes: int
    window_bytes: int = 0

    @property
    def slots_per_device(self) -> int:
        """B / data: the slots whose cache one device holds."""
        return self.slots // self.mesh[0]

    @property
    def cache_bytes(self) -> int:
        """The device's KV cache: slots_per_device x S x token_bytes."""
        return self.slots_per_device * self.max_len * self.token_bytes

    @property
    def used_bytes(self) -> int:
        """params + KV cache (and window rings) + scratch + reserve."""
        return (self.param_bytes + self.cache_bytes + self.window_bytes + self.scratch_bytes
                + self.reserve_bytes)

    @property
    def free_bytes(self) -> int | None:
        """memory - used (None when the memory is unknown)."""
        return None if self.memory_bytes is None else self.memory_bytes - self.used_bytes

    def describe(self) -> str:
        """The plan in a few human-readable lines, for the start-up log."""
        data, model = self.mesh
        mem = ("unknown (not checked: the platform reports no limit; pass --memory-gb)"
               if self.memory_bytes is None else _gib(self.memory_bytes))
        lines = [
            f"memory plan: mesh {format_mesh(self.mesh)} ({_n(data * model, 'device')}); "
            f"KV cache {_n(self.slots, 'slot')} x {self.max_len} tokens",
            f"  per device: memory {mem}",
            f"    params   {_gib(self.param_bytes)}",
            f"    KV cache {_gib(self.cache_bytes)} ({_n(self.slots_per_device, 'slot')} x "
            f"{self.max_len} tokens x {self.token_bytes / 1024:.1f} KiB per slot-token)",
            *([f"    windows  {_gib(self.window_bytes)} (the sliding layers' rings, "
               "whatever the context)"] if self.window_bytes else []),
            f"    scratch  {_gib(self.scratch_bytes)} (largest prefill, decode logits)",
            f"    reserve  {_gib(self.reserve_bytes)} (XLA workspace, fragmentation)",
        ]
        if self.free_bytes is not None:
            lines.append(f"    free     {_gib(self.free_bytes)}")
        return "\n".join(lines)


def _n(count: int, noun: str) -> str:
    return f"{count} {noun}" + ("" if count == 1 else "s")


def _gib(n: int) -> str:
    return f"{n / GiB:.2f} GiB"


# ---- the device's memory -------------------------------------------------------------------
def device_memory_bytes(devices: Sequence[Any] | None = None,
                        memory_gb: float | None = None) -> int | None:
    """The memory of one device in bytes: `memory_gb` GiB when given, else the smallest
    `memory_stats()["bytes_limit"]` of `devices` (default: this process's devices), else None
    (the platform reports none, as XLA:CPU does)."""
    if memory_gb is not None:
        if not memory_gb > 0 or math.isinf(memory_gb):
            raise InvalidParameterError(f"memory_gb={memory_gb!r} must be a positive number",
                                        param="memory_gb")
        return int(memory_gb * GiB)
    if devices is None:
        devices = jax.local_devices()
    limits = []
    for device in devices:
        try:
            stats = device.memory_stats()
        except Exception:  # some backends raise instead of returning None
            stats = None
        if not stats or not stats.get("bytes_limit"):
            return None
        limits.append(int(stats["bytes_limit"]))
    return min(limits) if limits else None


# ---- what the shapes cost ------------------------------------------------------------------
def _sizes(mesh_shape: tuple[int, int]) -> dict[str, int]:
    return {"data": mesh_shape[0], "model": mesh_shape[1]}


@functools.lru_cache(maxsize=32)
def _param_elements_per_device(cfg: ModelConfig, mesh_shape: tuple[int, int]) -> tuple[int, int]:
    """(float elements, bytes of the rest) of one device's share of `cfg`'s params: the rest
    are the weights `cfg.quantization` quantizes (int8, or int4 packed two a byte) and an
    int4 weight's float16 block scales, which keep their dtype (other scales are float)."""
    _, abstract = abstract_model(cfg)
    sizes = _sizes(mesh_shape)
    specs = jax.tree.leaves(param_specs(abstract, sizes),
                            is_leaf=lambda x: isinstance(x, PartitionSpec))
    floats = fixed = 0
    for x, spec in zip(jax.tree.leaves(abstract), specs, strict=True):
        n = math.prod(shard_shape(x.shape, spec, sizes))
        if x.dtype in (jnp.int8, jnp.uint8, jnp.float16):
            fixed += n * x.dtype.itemsize
        else:
            floats += n
    return floats, fixed


@functools.lru_cache(maxsize=8)
def _vision_elements(cfg: ModelConfig) -> int:
    from metrale_jax.models.vision import abstract_vision
    _, abstract = abstract_vision(cfg.vision)
    return sum(math.prod(x.shape) for x in jax.tree.leaves(abstract))


def param_bytes_per_device(cfg: ModelConfig, itemsize: int, mesh_shape: tuple[int, int],
                           quantization: str | None = None) -> int:
    """Bytes of one device's share of the params (`itemsize` bytes per float element),
    replicated tensors counted whole (a vision-language model's vision encoder is replicated).
    `quantization` ("int8" / "int8-all" / "int4", or `cfg.quantization` when None): int8
    weights count 1 byte per element and their per-output-channel scales `itemsize` (the
    engine casts float params, those scales too, to the compute dtype; `models/quant.py`);
    int4 weights half a byte and their float16 block scales 2 bytes (`models/quant4.py`)."""
    if quantization is not None and cfg.quantization is None:
        cfg = dataclasses.replace(cfg, quantization=quantization)
    vision = _vision_elements(cfg) if cfg.vision is not None else 0
    floats, fixed = _param_elements_per_device(cfg, tuple(mesh_shape))
    return (floats + vision) * itemsize + fixed


def image_bytes_per_device(cfg: ModelConfig, itemsize: int, images: int) -> int:
    """A vision-language model's image feature pool (`images` x T_img x E, replicated) and
    one vision program's temporaries over them (float32 activations and one layer's
    attention scores); 0 for a text-only model."""
    v = cfg.vision
    if v is None:
        return 0
    P = v.num_positions
    pool = images * v.tokens_per_image * cfg.hidden_size * itemsize
    activations = images * P * (4 * v.hidden_size + 2 * v.intermediate_size) * 4
    scores = images * v.num_heads * P * P * 4
    return pool + activations + scores


def kv_heads_per_device(cfg: ModelConfig, mesh_shape: tuple[int, int]) -> int:
    """K / model when the kv heads shard over `model`, else K (replicated)."""
    spec = partition_spec(("kv_heads",), _sizes(mesh_shape), (cfg.num_kv_heads,))
    return cfg.num_kv_heads // (mesh_shape[1] if spec[0] == "model" else 1)


def token_bytes_per_device(cfg: ModelConfig, cache_itemsize: int,
                           mesh_shape: tuple[int, int], layers: int | None = None) -> int:
    """KV cache bytes of one token of one slot on the device holding the slot:
    L x 2 (keys, values) x K_dev x D x itemsize; an int8 cache (itemsize 1) stores each row
    with its float32 scale, `D + 4` bytes (`models/kv_quant.py`). layers: count only that
    many layers (None: all L)."""
    row = (stored_head_dim(cfg.head_dim, "int8") if cache_itemsize == 1
           else cfg.head_dim * cache_itemsize)
    L = cfg.num_layers if layers is None else layers
    return L * 2 * kv_heads_per_device(cfg, mesh_shape) * row


def scratch_bytes_per_device(cfg: ModelConfig, *, itemsize: int, cache_itemsize: int,
                             mesh_shape: tuple[int, int], slots: int, max_len: int,
                             prefill_len: int, prefill_batch: int,
                             source_len: int = 0, images: int = 0) -> int:
    """An estimate of the temporaries of the largest step: a prefill of `prefill_batch` x
    `prefill_len` tokens (its keys and values for every layer, the attention scores of one
    layer over the cache plus the chunk in float32, hidden activations) or a decode step's
    logits and sampling copies `[B / data, V] float32`, whichever is larger; plus, for an
    encoder-decoder, every slot's cross-attention cache of `source_len` positions; for a
    vision-language model, its pool of `images` images' features and the vision program's
    temporaries (`image_bytes_per_device`)."""
    data, model = mesh_shape
    P, Bp = min(prefill_len, max_len), prefill_batch
    heads = cfg.num_heads // (model if cfg.num_heads % model == 0 else 1)
    mlp = cfg.intermediate_size // (model if cfg.intermediate_size % model == 0 else 1)
    prefix = Bp * P * token_bytes_per_device(cfg, cache_itemsize, mesh_shape)
    scores = Bp * heads * P * (P + max_len) * 4
    hidden = Bp * P * (4 * cfg.hidden_size + 3 * mlp) * itemsize
    prefill = prefix + scores + hidden + Bp * cfg.vocab_size * 4
    decode = -(-slots // data) * cfg.vocab_size * 4 * SAMPLING_COPIES
    side = itemsize if cache_itemsize == 1 else cache_itemsize  # an int8 cache keeps these float
    return (max(prefill, decode)
            + cross_bytes_per_device(cfg, side, mesh_shape, slots, source_len)
            + image_bytes_per_device(cfg, side, images))


def cross_bytes_per_device(cfg: ModelConfig, cache_itemsize: int, mesh_shape: tuple[int, int],
                           slots: int, source_len: int) -> int:
    """An encoder-decoder's cross-attention cache on one device: each of its slots (B / data)
    holds `source_len` positions of L x 2 x K_dev x D (0 for a decoder-only model)."""
    if cfg.encoder_decoder is None:
        return 0
    return (-(-slots // mesh_shape[0]) * source_len
            * token_bytes_per_device(cfg, cache_itemsize, mesh_shape))


# ---- the plan ------------------------------------------------------------------------------
def plan_memory(cfg: ModelConfig, *, itemsize: int, cache_itemsize: int,
                mesh_shape: tuple[int, int], memory_bytes: int | None,
                slots: int | None = None, max_len: int | None = None,
                prefill_len: int = 512, prefill_batch: int = 1,
                reserve_fraction: float = 0.1, source_len: int = 0,
                images: int = 0, quantization: str | None = None,
                window_columns: int = 0, page_size: int = 16) -> MemoryPlan:
    """The largest KV cache that fits in `memory_bytes` per device beside the params.

    itemsize / cache_itemsize: bytes per param / cache element (4 float32, 2 bfloat16, 1 int8:
    rows of D int8 values and a float32 scale);
    mesh_shape: (data, model); slots (B) and max_len (S): requested values, or None to choose.
    Choosing: S defaults to min(model's max positions, 4096) and B to as many slots as fit (a
    multiple of data, at most 256 per data shard); when B reaches that cap, S grows (up to the
    model's max positions); when not even `data` slots fit, S shrinks (a multiple of 128).
    Given both, the plan is checked. quantization: the weight mode ("int8" / "int8-all", None:
    `cfg.quantization`), whose int8 weights count 1 byte each (`param_bytes_per_device`).
    window_columns: W > 0 when the sliding-window layers keep rings of W pages of
    `page_size` per slot (`models/window_cache.py`): they count as `window_bytes`, the
    paged cache only the other layers.
    Raises `MemoryPlanError` (nothing allocated) when the params alone, or the requested
    cache, do not fit, or the memory is unknown and B or S is not given; and
    `InvalidParameterError` when B is not a multiple of the data axis.
    """
    data = mesh_shape[0]
    where = f"on mesh {format_mesh(mesh_shape)}"
    if slots is not None and (slots < 1 or slots % data):
        raise InvalidParameterError(
            f"max_slots={slots} must be a positive multiple of the mesh's data axis ({data}): "
            "each data shard holds the same number of slots", param="max_slots")
    if max_len is not None and max_len < 2:
        raise InvalidParameterError(f"max_len={max_len} must be at least 2", param="max_len")
    params = param_bytes_per_device(cfg, itemsize, mesh_shape, quantization)
    sliding = sum(bool(k) for k in cfg.layer_is_sliding) if window_columns else 0
    token = token_bytes_per_device(cfg, cache_itemsize, mesh_shape, cfg.num_layers - sliding)
    ring = window_columns * page_size * token_bytes_per_device(cfg, cache_itemsize, mesh_shape,
                                                               sliding)

    def plan(b: int, s: int) -> MemoryPlan:
        scratch = scratch_bytes_per_device(
            cfg, itemsize=itemsize, cache_itemsize=cache_itemsize, mesh_shape=mesh_shape,
            slots=b, max_len=s, prefill_len=prefill_len, prefill_batch=prefill_batch,
            source_len=source_len, images=images)
        reserve = int(reserve_fraction * memory_bytes) if memory_bytes is not None else 0
        return MemoryPlan(tuple(mesh_shape), b, s, memory_bytes, params, token, scratch,
                          reserve, b * ring)

    if memory_bytes is None:
        if slots is None or max_len is None:
            raise MemoryPlanError(
                "the devices report no memory limit (as on CPU), so the KV cache cannot be "
                "sized automatically: pass --memory-gb, or both --max-slots and --max-len")
        return plan(slots, max_len)

    def fits(b: int, s: int) -> bool:
        return plan(b, s).free_bytes >= 0

    base = plan(data, 2)
    if params + base.reserve_bytes > memory_bytes:
        raise MemoryPlanError(
            f"the params need {_gib(params)} per device {where} (plus a reserve of "
            f"{_gib(base.reserve_bytes)}), more than the {_gib(memory_bytes)} a device has: "
            "use a larger model axis, a smaller dtype, or devices with more memory")
    longest = cfg.max_position_embeddings
    if slots is not None and max_len is not None:
        if not fits(slots, max_len):
            need = plan(slots, max_len)
            raise MemoryPlanError(
                f"{_n(slots, 'slot')} x {max_len} tokens do not fit {where}: a device needs "
                f"{_gib(need.used_bytes)} (params {_gib(need.param_bytes)}, KV cache "
                f"{_gib(need.cache_bytes)}, scratch {_gib(need.scratch_bytes)}, reserve "
                f"{_gib(need.reserve_bytes)}) but has {_gib(memory_bytes)}; "
                f"{_hint(cfg, mesh_shape, fits, slots, max_len)}")
        return plan(slots, max_len)
    if slots is not None:
        s = _largest_len(lambda s: fits(slots, s), max(longest, 2))
        if s is None:
            raise MemoryPlanError(
                f"{_n(slots, 'slot')} do not fit {where} even with a 2-token cache "
                f"({_gib(memory_bytes)} per device, params {_gib(params)}): use fewer slots")
        return plan(slots, s)
    s = max_len if max_len is not None else min(longest, DEFAULT_LEN)
    b = _largest_slots(lambda b: fits(b, s), data)
    if b is None:
        if max_len is not None:
            raise MemoryPlanError(
                f"not even {_n(data, 'slot')} of {max_len} tokens fit {where} "
                f"({_gib(memory_bytes)} per device, params {_gib(params)}); "
                f"{_hint(cfg, mesh_shape, fits, data, max_len)}")
        s = _largest_len(lambda s: fits(data, s), s)
        if s is None:
            raise MemoryPlanError(
                f"no KV cache fits {where} beside the params ({_gib(params)} of "
                f"{_gib(memory_bytes)} per device): use a larger model axis or a smaller dtype")
        return plan(data, s)
    if b == MAX_AUTO_SLOTS * data and max_len is None:
        s = max(s, _largest_len(lambda s: fits(b, s), max(longest, s)) or s)
    return plan(b, s)


def _largest_slots(ok, data: int) -> int | None:
    """The largest multiple of `data` up to MAX_AUTO_SLOTS x data with `ok(b)`, or None."""
    if not ok(data):
        return None
    lo, hi = 1, MAX_AUTO_SLOTS  # ok(lo * data) holds
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if ok(mid * data):
            lo = mid
        else:
            hi = mid - 1
    return lo * data


def _largest_len(ok, limit: int) -> int | None:
    """The largest S up to `limit` with `ok(S)`: a multiple of LENGTH_ALIGN when one fits,
    else the largest S below it (at least 2), or None."""
    def search(lo: int, hi: int, step: int) -> int | None:
        if hi < lo or not ok(lo * step):
            return None
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if ok(mid * step):
                lo = mid
            else:
                hi = mid - 1
        return lo * step
    if limit >= LENGTH_ALIGN:
        found = search(1, limit // LENGTH_ALIGN, LENGTH_ALIGN)
        if found is not None:
            return found
    return search(2, min(limit, LENGTH_ALIGN - 1), 1)


def _hint(cfg: ModelConfig, mesh_shape: tuple[int, int], fits, slots: int, max_len: int) -> str:
    """What would fit instead: fewer slots at this length, or a shorter cache."""
    data = mesh_shape[0]
    b = _largest_slots(lambda b: b <= slots and fits(b, max_len), data)
    s = _largest_len(lambda s: fits(slots, s), max_len)
    options = []
    if b is not None:
        options.append(f"{_n(b, 'slot')} x {max_len} tokens")
    if s is not None:
        options.append(f"{_n(slots, 'slot')} x {s} tokens")
    return ("what fits: " + " or ".join(options)) if options else (
        "use fewer slots, a shorter cache or a larger model axis")
