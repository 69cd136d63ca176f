"""The engine's LoRA adapter slots: the stacked adapter weights on the devices, and each row's
weight per slot on the host.

Per decoder layer and per adaptable projection (`models.lora.MODULES`) the slots hold
`a: [N, in, R]` and `b: [N, R, out]` (N = max_loras, R = max_lora_rank, replicated; ranks
zero-padded, each adapter's scale folded into its b). `mix: [B, N] float32` is each row's
weight per slot (zeros: the base model), host data sent with every step, so loading,
switching and mixing adapters never compiles (`models/lora.py` applies them).
"""

from __future__ import annotations

from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from metrale_jax.config import ModelConfig
from metrale_jax.engine.config import EngineConfig
from metrale_jax.engine.programs import ProgramCache, abstract, spec
from metrale_jax.errors import InvalidParameterError
from metrale_jax.models.lora import MODULES, module_shape


class Adapter(Protocol):
    """What `LoraSlots.set` reads of an adapter (`weights.lora.LoraAdapter` is one): its
    rank r, scale, and per target module `weights[m] = (a [L, in, r], b [L, r, out])`."""

    rank: int
    scale: float
    weights: dict[str, tuple[np.ndarray, np.ndarray]]


class LoraSlots:
    """The adapter slots of an engine (none when `max_loras` is 0: `weights` is None and a
    step gets no LoRA arguments). Attributes: weights, per layer `{module: (a, b)}` on the
    devices; mix, `[B, max(N, 1)] float32` each row's weight per slot."""

    def __init__(self, config: EngineConfig, model_config: ModelConfig,
                 replicated: NamedSharding, cache: ProgramCache):
        self.config, self.cache, self.replicated = config, cache, replicated
        N, R = config.max_loras, config.max_lora_rank
        self.mix = np.zeros((config.max_slots, max(N, 1)), np.float32)
        self.weights: tuple[dict[str, tuple[jax.Array, jax.Array]], ...] | None = None
        if N:
            dtype = jnp.dtype(config.dtype)

            def zeros(*shape: int) -> jax.Array:
                return jax.device_put(np.zeros(shape, dtype), replicated)

            self.weights = tuple(
                {m: (zeros(N, module_shape(model_config, m)[0], R),
                     zeros(N, R, module_shape(model_config, m)[1])) for m in MODULES}
                for _ in range(model_config.num_layers))

    def specs(self) -> tuple[Any, Any]:
        """The abstract LoRA inputs of a step: the slots' weights and the rows' mix; (None,
        None) without slots."""
        if self.weights is None:
            return (None, None)
        return abstract(self.weights), spec(self.mix.shape, jnp.float32)

    def args(self) -> tuple[Any, Any]:
        """The LoRA arguments of a step: the slots' weights and each row's mix (a copy: the
        host changes it before a queued step reads it); (None, None) without slots."""
        if self.weights is None:
            return (None, None)
        return (self.weights, self.mix.copy())

    def set_row(self, row: int, adapters: tuple[tuple[int, float], ...]) -> None:
        """Row `row` uses `adapters`, (slot, weight) pairs (empty: none)."""
        self.mix[row] = 0
        for slot, weight in adapters:
            self.mix[row, slot] = weight

    def _program(self) -> Any:
        """The program that writes one slot's weights (the slots' arrays donated)."""
        def put(lora, slot, weights):
            return jax.tree.map(lambda s, w: s.at[slot].set(w), lora, weights)
        slot_spec = jax.tree.map(lambda x: spec(x.shape[1:], x.dtype), self.weights)
        fn = jax.jit(put, donate_argnums=(0,), out_shardings=self.replicated)
        return self.cache.compile(("lora_set",), fn, abstract(self.weights),
                                  spec((), jnp.int32), slot_spec)

    def set(self, slot: int, adapter: Adapter | None) -> None:
        """Loads `adapter` into slot `slot`, or clears the slot (None). Its rank must be at
        most `max_lora_rank`; its scale is folded into b. Rows already using the slot see
        the new weights from the next step."""
        cfg = self.config
        if self.weights is None:
            raise InvalidParameterError("this engine has no LoRA slots (max_loras=0)",
                                        param="lora")
        if not 0 <= slot < cfg.max_loras:
            raise InvalidParameterError(f"LoRA slot {slot} is not in [0, {cfg.max_loras})",
                                        param="lora")
        R = cfg.max_lora_rank
        if adapter is not None and adapter.rank > R:
            raise InvalidParameterError(f"adapter rank {adapter.rank} exceeds max_lora_rank {R}",
                                        param="lora")
        dtype = jnp.dtype(cfg.dtype)
        weights = []
        for layer, slots in enumerate(self.weights):
            one = {}
            for m, (a, b) in slots.items():
                wa = np.zeros(a.shape[1:], dtype)
                wb = np.zeros(b.shape[1:], dtype)
                if adapter is not None and m in adapter.weights:
                    A, Bm = adapter.weights[m]
                    r = adapter.rank
                    wa[:, :r] = A[layer]
                    wb[:r] = Bm[layer] * adapter.scale
                one[m] = (wa, wb)
            weights.append(one)
        self.weights = self._program()(self.weights, np.int32(slot), tuple(weights))
