"""Where the engine's arrays live: its mesh, its memory plan, and every compiled step's shardings.

`place(model_config, engine_config)` runs before anything is allocated (it reads shapes and the
devices' memory limits, nothing else):
1. the mesh: `EngineConfig.mesh`, else `sharding.default_mesh_shape` for the model's head counts
   and `jax.device_count()` devices (every process's devices: on several hosts one mesh spans
   them all); logged with the reason;
2. the memory plan (`memory_plan.plan_memory`) on that mesh: it fills in `max_slots` /
   `max_len` left None and refuses, with `MemoryPlanError`, a configuration that does not fit;
   its `describe()` is logged;
and returns a `Placement` whose `config` is the resolved `EngineConfig` (mesh as a tuple).

`StepShardings` declares where every argument and result of the compiled steps
(`engine/steps.py`) lives, from the logical-axis rules of `engine/sharding.py`:
- params: `param_shardings` (heads, kv heads, MLP and vocabulary on "model");
- the `DecodeState`: the page pools `[N, ps, 2K, D]` per layer over kv heads ("model"; pages
  are shared by all rows, so not over "data"); every per-slot array (positions, tokens,
  steps `[B]`, the sampling settings and token history `[B, ...]`) over slots;
- host inputs (the page table, the active mask, grammar masks, the chunk's tokens, rows and
  positions, the finishing prompts' sampling rows) and the `StepOutput`s the host reads:
  replicated. Every process passes the same small host arrays, and reads the outputs from its
  own devices without a gather.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from metrale_jax.config import ModelConfig
from metrale_jax.engine import steps
from metrale_jax.engine.config import EngineConfig
from metrale_jax.engine.memory_plan import MemoryPlan, device_memory_bytes, plan_memory
from metrale_jax.engine.sharding import (
    check_mesh_shape,
    default_mesh_shape,
    format_mesh,
    make_mesh,
    named_sharding,
    page_pool_sharding,
    param_shardings,
    replicated,
    shard_params,
    slot_sharding,
)
from metrale_jax.engine.state import DecodeState
from metrale_jax.errors import InvalidParameterError, MemoryPlanError
from metrale_jax.models.quant4 import is_block_scale
from metrale_jax.models.quantized_model import quantize_state
from metrale_jax.models.scanned import StackedLayerParams, layer_group, stack_layers
from metrale_jax.models.seq2seq_ragged import CROSS_AXES, CrossCache, split_seq2seq
from metrale_jax.models.transformer import rope_for_context
from metrale_jax.models.unrolled import LayerParams, split_layers
from metrale_jax.models.window_cache import WindowedPools

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Placement:
    """The mesh and memory plan of an engine, decided before anything is allocated.

    mesh_shape: (data, model); why: the reason, one sentence; plan: the `MemoryPlan`;
    config: the resolved `EngineConfig` (max_slots, max_len and mesh filled in).
    """

    mesh_shape: tuple[int, int]
    why: str
    plan: MemoryPlan
    config: EngineConfig

    @property
    def device_bytes(self) -> int:
        """What the engine holds on each device: params, the KV page pool (`config.num_pages`
        pages), the sliding-window rings and the step scratch (the plan's reserve, shared
        by whatever else runs on the device, is not counted)."""
        pool = self.config.resolved_num_pages * self.config.page_size * self.plan.token_bytes
        return (self.plan.param_bytes + pool + self.plan.window_bytes
                + self.plan.scratch_bytes)

    def make_mesh(self) -> Mesh:
        """The `("data", "model")` mesh over the first data x model devices."""
        return make_mesh(*self.mesh_shape)


def choose_mesh(model_config: ModelConfig, requested: tuple[int, int] | None,
                n_devices: int, slots: int | None = None) -> tuple[tuple[int, int], str]:
    """The mesh shape for `n_devices` devices and why: `requested` when given (checked
    against the devices), else `default_mesh_shape`; when that mesh's data axis does not
    divide a given number of `slots` (1 slot on 8 devices for a model on data), the default
    for the most devices whose data axis does."""
    if requested is None:
        for n in range(n_devices, 0, -1):
            shape, why = default_mesh_shape(model_config, n)
            if slots is None or slots % shape[0] == 0:
                if n < n_devices:
                    why += (f" (on {n} of {n_devices} devices: a data axis over all of them "
                            f"would not divide max_slots={slots})")
                return shape, why
    assert requested is not None
    check_mesh_shape(requested, n_devices)
    data, model = requested
    why = f"as configured (mesh {format_mesh(requested)})"
    if data * model < n_devices:
        why += f"; {n_devices - data * model} of {n_devices} devices left unused"
    return requested, why


def place(model_config: ModelConfig, config: EngineConfig,
          n_devices: int | None = None) -> Placement:
    """Chooses the mesh and plans memory for `config` (see the module docstring); logs both.

    Raises `InvalidParameterError` (a mesh the devices cannot hold, slots that do not divide
    by the data axis) or `MemoryPlanError` (it does not fit, or the memory is unknown and
    max_slots / max_len are not both given) before anything is allocated.
    """
    n = jax.device_count() if n_devices is None else n_devices
    shape, why = choose_mesh(model_config, config.mesh, n, config.max_slots)
    log.info("mesh %s: %s", format_mesh(shape), why)
    plan = plan_memory(
        model_config, itemsize=jnp.dtype(config.dtype).itemsize,
        cache_itemsize=jnp.dtype(config.resolved_cache_dtype).itemsize, mesh_shape=shape,
        memory_bytes=device_memory_bytes(memory_gb=config.memory_gb), slots=config.max_slots,
        max_len=config.max_len, prefill_len=config.max_prefill_len or 512,
        prefill_batch=config.max_prefill_batch or 4, source_len=config.max_source_len,
        images=config.max_images, quantization=model_config.quantization or config.quantization,
        window_columns=config.window_columns(model_config), page_size=config.page_size)
    log.info("%s", plan.describe())
    resolved = config.with_shapes(plan.slots, plan.max_len, shape)
    resolved = dataclasses.replace(resolved, num_pages=plan_pages(plan, resolved))
    pages, ps = resolved.num_pages - 1, resolved.page_size
    log.info("KV pages: %d of %d tokens (%.2f GiB per device): %d tokens in all, %d sequences "
             "of max_len %d, %d of 256 tokens", pages, ps,
             resolved.num_pages * ps * plan.token_bytes / 2**30, pages * ps,
             pages // resolved.pages_per_seq, resolved.max_len, pages // -(-256 // ps))
    return Placement(shape, why, plan, resolved)


def plan_pages(plan: MemoryPlan, config: EngineConfig) -> int:
    """N, the page pool (null page included) for `config` (max_slots / max_len resolved).

    Where the memory is known, the pool takes every byte the plan leaves to the KV cache
    (memory - params - scratch - reserve): sequences hold only the pages their tokens need,
    so short requests fit many more sequences than slots x max_len. Each device holds the
    pages of every row (the pool is not split over "data"). A configured `num_pages` is
    checked against the same budget. Unknown memory (CPU without --memory-gb): the configured
    `num_pages`, else room for every slot to hold max_len.
    """
    page_bytes = config.page_size * plan.token_bytes
    if plan.memory_bytes is None:
        return config.resolved_num_pages
    budget = (plan.memory_bytes - plan.param_bytes - plan.scratch_bytes - plan.reserve_bytes
              - plan.window_bytes)
    fits = budget // page_bytes
    if config.num_pages is not None:
        if config.num_pages > fits:
            raise MemoryPlanError(
                f"num_pages={config.num_pages} pages of {config.page_size} tokens need "
                f"{config.num_pages * page_bytes / 2**30:.2f} GiB per device; "
                f"{max(0, fits)} fit beside the params", param="num_pages")
        return config.num_pages
    return max(2, fits)


def place_params(model_config: ModelConfig, graphdef: nnx.GraphDef, params: Any,
                 config: EngineConfig, mesh: Mesh
                 ) -> tuple[ModelConfig, Any, LayerParams | StackedLayerParams]:
    """An engine's params from a split NNX model's stacked `[L, ...]` params: quantized
    when `config.quantization` asks it of a float model, floats cast to `config.dtype`
    (quantized weights keep their dtype, and so do int4 block scales, float16:
    `models/quant4.py`), split per layer (`models/unrolled.py`; an encoder-decoder's decoder:
    `models/seq2seq_ragged.py`) or kept stacked for the scanned layer loop
    (`config.scans_layers`, `models/scanned.py`), and sharded on `mesh`. Returns the model
    config (quantized where it was), the per-layer graph and the `LayerParams` (or
    `StackedLayerParams`). Raises `InvalidParameterError` for `layer_loop="scan"` with an
    encoder-decoder model (its decoder runs unrolled)."""
    if model_config.is_encoder_decoder and config.layer_loop == "scan":
        raise InvalidParameterError(
            "engine config: layer_loop='scan' is for decoder-only models; an encoder-decoder "
            "model runs its layers unrolled (layer_loop='unrolled' or None)", param="layer_loop")
    # LongRoPE's factors for this engine's context (docs/architecture.md, "RoPE").
    model_config, graphdef = rope_for_context(model_config, graphdef, config.max_len)
    if config.quantization and model_config.quantization is None:  # a float model given
        model_config, graphdef, params = quantize_state(model_config, params,
                                                        config.quantization)
    dtype = jnp.dtype(config.dtype)
    params = jax.tree_util.tree_map_with_path(
        lambda path, x: jnp.asarray(x, dtype) if jnp.issubdtype(x.dtype, jnp.floating)
        and not is_block_scale(path, x) else jnp.asarray(x), params)
    # The stacked copy is dropped once split. Plain dicts of arrays, not nnx States: every
    # step's call flattens the params, which JAX does in C++ for dicts but through Python for
    # States (483 leaves on the default model: 0.46 ms a step, about 5% of an int8 decode
    # step).
    if config.scans_layers(model_config.is_encoder_decoder, model_config.quantization,
                           layer_group(model_config)):
        graph, stacked = stack_layers(graphdef, params)
        return model_config, graph, shard_params(StackedLayerParams(
            nnx.to_pure_dict(stacked.outer), nnx.to_pure_dict(stacked.blocks)), mesh)
    split = split_seq2seq if model_config.is_encoder_decoder else split_layers
    graph, layers = split(graphdef, params)
    del params
    placed = shard_params(LayerParams(
        nnx.to_pure_dict(layers.outer),
        tuple(nnx.to_pure_dict(layer) for layer in layers.layers)), mesh)
    return model_config, graph, placed


class PlacementHook:
    """Places an engine while its checkpoint loads: `load_checkpoint(path, dtype,
    shardings=hook)` calls `hook(model_config, dtype)` before any weight is read, which runs
    `place` (so an impossible configuration fails before anything is allocated) and returns
    the param shardings on the chosen mesh (an orbax checkpoint restores straight into them).
    Afterwards `hook.placement` goes to `Engine(..., placement=hook.placement)`.

    config: the engine config as asked (its dtype is replaced by the checkpoint's).
    """

    def __init__(self, config: EngineConfig):
        self.config = config
        self.placement: Placement | None = None

    def __call__(self, model_config: ModelConfig, dtype: str):
        self.placement = place(model_config, dataclasses.replace(self.config, dtype=dtype))
        return functools.partial(param_shardings, mesh=self.placement.make_mesh())


class StepShardings:
    """The shardings of the compiled steps' arguments and results on `mesh` (see the module
    docstring). Attributes: replicated; state (a `DecodeState` of shardings);
    params(tree) -> shardings."""

    def __init__(self, mesh: Mesh, model_config: ModelConfig, config: EngineConfig):
        self.mesh = mesh
        self.replicated: NamedSharding = replicated(mesh)
        self.state = self._state(model_config, config)

    def params(self, params) -> object:
        """The shardings of a params pytree (stacked or `LayerParams`)."""
        return param_shardings(params, self.mesh)

    def _state(self, model_config: ModelConfig, config: EngineConfig) -> DecodeState:
        B, N, ps = config.max_slots, config.resolved_num_pages, config.page_size
        spec = jax.eval_shape(functools.partial(
            steps.init_state, model_config, B, 2, 2, ps, jnp.dtype(config.resolved_cache_dtype),
            float_dtype=jnp.dtype(config.dtype), pooled=config.pooled_output))

        def per_slot(a: jax.ShapeDtypeStruct) -> NamedSharding:  # [B, ...]: slots on data
            return slot_sharding(B, self.mesh, a.ndim - 1)

        slots = slot_sharding(B, self.mesh)
        stacked = config.scans_layers(model_config.is_encoder_decoder,
                                      model_config.quantization, layer_group(model_config))

        def pools(layers: int, num_pages: int):
            if stacked:
                return page_pool_sharding(model_config, num_pages, ps, self.mesh, stacked=True)
            return (page_pool_sharding(model_config, num_pages, ps, self.mesh),) * layers

        columns = config.window_columns(model_config)
        if columns:  # the sliding layers' rings (models/window_cache.py)
            sliding = sum(bool(s) for s in model_config.layer_is_sliding)
            pages = WindowedPools(pools(model_config.num_layers - sliding, N),
                                  pools(sliding, B * columns + 1))
        else:
            pages = pools(model_config.num_layers, N)
        return DecodeState(
            pages=pages,
            positions=slots,
            tokens=slots, steps=slots, sampling=jax.tree.map(per_slot, spec.sampling),
            history=jax.tree.map(per_slot, spec.history),
            cross=self._cross(model_config, config),
            images=self.replicated if model_config.vision is not None else None,
            pool_sums=None if spec.pool_sums is None else per_slot(spec.pool_sums))

    def _cross(self, model_config: ModelConfig, config: EngineConfig) -> CrossCache | None:
        """An encoder-decoder's cross-attention buffers: slots on data, heads on model."""
        if not model_config.is_encoder_decoder:
            return None
        B, S = config.max_slots, config.max_source_len
        K, D = model_config.num_kv_heads, model_config.head_dim
        one = named_sharding(CROSS_AXES, self.mesh, (B, S, K, D))
        L = model_config.num_layers
        return CrossCache((one,) * L, (one,) * L, slot_sharding(B, self.mesh))
