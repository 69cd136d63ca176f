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
- the `DecodeState`: the KV cache `[B, K, D, S]` / `[B, K, S, D]` per layer over slots ("data")
  and kv heads ("model"); every per-slot array (positions, tokens, steps `[B]`, the sampling
  settings and token history `[B, ...]`) over slots;
- host inputs (prompt tokens, lengths, a prefill batch's sampling rows, slot indices, the
  active mask) and the `StepOutput`s the host reads: replicated. Every process passes the same
  small host arrays, and reads the outputs from its own devices without a gather;
- a standalone `Prefix` (the contract's separate `prefill`): its cache over kv heads only, the
  rest replicated (its rows are a prefill batch, not slots: they need not divide by "data").
"""

from __future__ import annotations

import dataclasses
import functools
import logging

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding

from metrale_jax.config import ModelConfig
from metrale_jax.engine import steps
from metrale_jax.engine.config import EngineConfig
from metrale_jax.engine.memory_plan import MemoryPlan, device_memory_bytes, plan_memory
from metrale_jax.engine.sharding import (
    check_mesh_shape,
    default_mesh_shape,
    format_mesh,
    layer_cache_shardings,
    make_mesh,
    named_sharding,
    param_shardings,
    replicated,
    slot_sharding,
)
from metrale_jax.engine.state import DecodeState
from metrale_jax.models.kv_cache import KVCache

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
        prefill_batch=config.max_prefill_batch or 4)
    log.info("%s", plan.describe())
    resolved = config.with_shapes(plan.slots, plan.max_len, shape)
    return Placement(shape, why, plan, resolved)


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
    docstring). Attributes: replicated; state (a `DecodeState` of shardings); prefix (a
    `Prefix` of shardings, for the standalone prefill/insert); params(tree) -> shardings."""

    def __init__(self, mesh: Mesh, model_config: ModelConfig, config: EngineConfig):
        self.mesh = mesh
        self.replicated: NamedSharding = replicated(mesh)
        self.state = self._state(model_config, config)
        cfg = model_config
        cache = named_sharding((None, None, "kv_heads", None, None), mesh,
                               (1, 1, cfg.num_kv_heads, 1, 1))
        rep = self.replicated
        self.prefix = steps.Prefix(KVCache(cache, cache), rep, rep, rep, rep)

    def params(self, params) -> object:
        """The shardings of a params pytree (stacked or `LayerParams`)."""
        return param_shardings(params, self.mesh)

    def _state(self, model_config: ModelConfig, config: EngineConfig) -> DecodeState:
        B, S = config.max_slots, config.max_len
        spec = jax.eval_shape(functools.partial(
            steps.init_state, model_config, B, 2, jnp.dtype(config.resolved_cache_dtype)))

        def per_slot(a: jax.ShapeDtypeStruct) -> NamedSharding:  # [B, ...]: slots on data
            return slot_sharding(B, self.mesh, a.ndim - 1)

        slots = slot_sharding(B, self.mesh)
        return DecodeState(
            cache=layer_cache_shardings(model_config, B, S, self.mesh), positions=slots,
            tokens=slots, steps=slots, sampling=jax.tree.map(per_slot, spec.sampling),
            history=jax.tree.map(per_slot, spec.history))
