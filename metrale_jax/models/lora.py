"""LoRA on the device: every token of a step with its own adapter, in one batched computation.

An engine with LoRA holds, per decoder layer and per adaptable projection (`MODULES`, Hugging
Face's names), the stacked adapters of its N slots: `a: [N, in, R]` and `b: [N, R, out]`, ranks
zero-padded to the maximum R and each adapter's scale folded into its `b`. A token's adapters
are data: `mix: [T, N] float32`, the weight of each slot for that token (a row of zeros: the base
model; one 1.0: vLLM's one adapter per request; any scales: llama.cpp's per-request list), so
loading, switching, scaling and mixing adapters never compiles.

`lora_delta(weights, mix)` returns the `layers.LoraDelta` the model's projections call: for
input `x: [T, in]`, `sum_n mix[:, n] (x @ a[n]) @ b[n]`, computed as `x @ a` for all slots at
once (`[T, N, R]`, small: N x R columns), weighted by each token's mix, then one product with
`b` seen as `[N * R, out]`. Its cost is about `2 T N R (in + out)` FLOPs per projection.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from metrale_jax.config import ModelConfig

MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The linear layers an adapter may target, in Hugging Face's names."""


def module_shape(cfg: ModelConfig, module: str) -> tuple[int, int]:
    """(in, out) features of `module` in one decoder layer of `cfg`."""
    E, H, K, D, F = (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                     cfg.intermediate_size)
    return {"q_proj": (E, H * D), "k_proj": (E, K * D), "v_proj": (E, K * D),
            "o_proj": (H * D, E), "gate_proj": (E, F), "up_proj": (E, F),
            "down_proj": (F, E)}[module]


def lora_delta(weights: dict[str, tuple[jax.Array, jax.Array]], mix: jax.Array):
    """The per-token update function of one layer: weights[m] = (a [N, in, R], b [N, R, out]);
    mix: [T, N] float32, each token's weight per slot (zeros: no adapter). Returns
    `delta(module, x [..., T, in]) -> [..., T, out]`."""

    used = jnp.any(mix != 0)

    def delta(module: str, x: jax.Array) -> jax.Array:
        a, b = weights[module]
        N, _, R = a.shape
        lead = x.shape[:-1]

        def compute(x):
            x2 = x.reshape(-1, x.shape[-1])
            xa = jnp.einsum("ti,nir->tnr", x2, a.astype(x.dtype))
            xa = xa * mix[:, :, None].astype(x.dtype)
            out = xa.reshape(x2.shape[0], N * R) @ b.astype(x.dtype).reshape(N * R, -1)
            return out.reshape(*lead, -1)

        # A step in which no token has an adapter skips the products.
        return jax.lax.cond(used, compute,
                            lambda x: jnp.zeros((*lead, b.shape[-1]), x.dtype), x)

    return delta
