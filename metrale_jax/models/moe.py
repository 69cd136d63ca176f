"""The mixture-of-experts MLP (Qwen3-MoE, Mixtral): a router, top-k routing and dropless
grouped expert products.

Dimension letters as DESIGN.md's, plus `X` experts, `k` experts per token and `A = T * k`
routed assignments; `F` here is each expert's width (`ModelConfig.moe_intermediate_size`).

Routing (`route`): router logits `[T, X]` in float32, softmax over the X experts, the top k
kept; with `norm_topk_prob` the k weights are renormalized to sum to 1 (Mixtral always, which
is the same as a softmax over the top k logits; Qwen3-MoE as its config says).

Dispatch is dropless: every token reaches exactly its k experts whatever the batch (no
capacity factor). The A assignments are sorted by expert (a stable sort: within an expert,
in token order), the tokens gathered in that order, and each projection is ONE grouped
product over the sorted rows, expert e's rows times expert e's weight; the outputs are
unsorted and each token sums its k outputs weighted by its routing weights, in top-k order
(so a token's result depends on its own routing only: the same alone or in any batch).

Two forms of the grouped product, picked statically per shape (T is static in a compiled
step; `dispatch_form`):
- "ragged": `jax.lax.ragged_dot` with the group sizes, the form TPU and GPU run (XLA's
  grouped matmul). On XLA:CPU it is expanded into a dense product over every expert (it
  reads all X experts' weights for every row): measured below, it is the slowest form there.
- "tiles" (CPU): the sorted rows padded per expert to a multiple of `m` rows, then a loop
  over the non-empty tiles (a dynamic trip count), each one `[m, E] @ [E, F]` product with
  its expert's weight read in place: each touched expert's weight is read about once.
  `m` grows with the rows per expert (`tile_rows`).

Measured on CPU (one thread, ms per MoE MLP; X=128, k=8, E=512, F=192, i.e. Qwen3-30B-A3B's
routing at a quarter of its width; `dense` is a dense MLP of the same active parameters,
F = 8 * 192):

    T      ragged_dot   gather-weights einsum   tiles m=1   m=4    m=8    m=32   dense
    1        11.8          0.96                   0.83       0.96   1.00   2.26   0.58
    4        40.3         18.9                    2.44       2.68   3.40   8.32   1.07
    16      121           72                     10.9        8.6   12.6   26.8    1.6
    64      288          172                     39.4       18.8   19.3   42.7    3.9
    256    1762            -                    152         61     47     34     12.3

On a mesh (experts sharded over "model", `engine/sharding.py`) the "ragged" form runs
everywhere: XLA's SPMD partitioner splits the `ragged_dot` by expert groups, so each device
multiplies the routed rows of its own experts (zeros for the others), the group sizes are
all-gathered (`s32[X]`) and the products' rows all-reduced (`f32[A, F]` / `[A, E]`): an
expert-parallel dispatch by all-gather of the routed tokens (every device routes every token:
the activations are replicated over "model") and an all-reduce combine. The "tiles" loop
would instead all-gather every expert's weights each step (checked on the compiled HLO).

A token's k experts are distinct weights, so a routed step reads up to `min(A, X)` experts'
weights where a dense model of the same active parameters reads k: at one decode row the
grouped product costs ~1.4x the dense one; with many rows it reads most experts
(`bench/moe.py`).

Weights (`MoE`): router `[E, X]` (float, never quantized), gate and up `[X, E, F]`, down
`[X, F, E]`; int8 ("int8", "int8-all") with per-expert, per-output-channel scales
`gate_scale` / `up_scale [X, F]`, `down_scale [X, E]` (`models/quant.py`'s format over each
expert's input axis). int4 is refused by `ModelConfig`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from metrale_jax.config import ModelConfig
from metrale_jax.models.quant import SCALE_SUFFIX, quantize

EXPERT_IN_AXES: dict[str, tuple[int, ...]] = {"gate": (1,), "up": (1,), "down": (1,)}
"""Per expert weight `[X, in, out]`: its input axis (the int8 scale is over the rest)."""

MOE_AXES = {
    "router": ("embed", None),                 # [E, X]
    "gate": ("experts", "embed", "mlp"),       # [X, E, F]
    "up": ("experts", "embed", "mlp"),         # [X, E, F]
    "down": ("experts", "mlp", "embed"),       # [X, F, E]
    "gate_scale": ("experts", "mlp"),          # [X, F]   (int8)
    "up_scale": ("experts", "mlp"),            # [X, F]
    "down_scale": ("experts", "embed"),        # [X, E]
}
"""Logical axes of `MoE`'s params: experts on their own logical axis (engine/sharding.py maps
it to the mesh), the expert width on "mlp" where the experts do not divide the mesh."""

FORMS = ("ragged", "tiles")
"""The grouped product's forms (see the module docstring)."""


def tile_rows(assignments: int, num_experts: int) -> int:
    """m, the rows of one tile of the "tiles" form for A assignments over X experts: 1 while
    fewer than half a row per expert (decode), else about twice the mean rows per expert,
    a power of two in 4 .. 32 (the measured best: the module docstring's table)."""
    mean = assignments / num_experts
    if mean < 0.5:
        return 1
    m = 4
    while m < 32 and m < 2 * mean:
        m *= 2
    return m


def dispatch_form(assignments: int, num_experts: int, backend: str | None = None,
                  devices: int | None = None) -> tuple[str, int]:
    """`(form, m)` for a step of A assignments (static): "tiles" with `tile_rows` on one CPU
    device; "ragged" (m 0) on TPU and GPU and on any mesh (XLA's SPMD partitioner splits a
    `ragged_dot` by expert groups; it would all-gather every expert's weights into the
    tiles' loop)."""
    backend = backend or jax.default_backend()
    devices = jax.device_count() if devices is None else devices
    if backend == "cpu" and devices == 1:
        return "tiles", tile_rows(assignments, num_experts)
    return "ragged", 0


def route(logits: jax.Array, k: int, normalize: bool) -> tuple[jax.Array, jax.Array]:
    """Router logits `[T, X]` -> `(weights [T, k] float32, experts [T, k] int32)`: softmax over
    X, the top k (ties to the lower expert), renormalized over the k when `normalize`."""
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probs, k)
    if normalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts.astype(jnp.int32)


def expert_counts(experts: jax.Array, num_experts: int,
                  real: jax.Array | None = None) -> jax.Array:
    """Assignments per expert, `[X] int32`, of `experts [T, k]`; real: `[T] bool`, the tokens
    counted (None: all)."""
    ones = jnp.ones(experts.shape, jnp.int32)
    if real is not None:
        ones = ones * real[:, None].astype(jnp.int32)
    return jnp.zeros((num_experts,), jnp.int32).at[experts.reshape(-1)].add(ones.reshape(-1))


ExpertWeights = dict[str, tuple[jax.Array, jax.Array | None]]
"""`{"gate": (w [X, E, F], scale [X, F] | None), "up": ..., "down": (w [X, F, E], ...)}`."""


def _activate(gate: jax.Array, up: jax.Array, act: str) -> jax.Array:
    gate = jax.nn.silu(gate) if act == "silu" else jax.nn.gelu(gate, approximate=True)
    return gate * up


def ragged_products(xs: jax.Array, sorted_experts: jax.Array, group_sizes: jax.Array,
                    w: ExpertWeights, act: str) -> jax.Array:
    """The "ragged" form: sorted rows `xs [A, E]` (rows of expert e contiguous, `group_sizes
    [X] int32`) -> `[A, E]`, one `jax.lax.ragged_dot` per projection; int8 outputs scaled by
    each row's expert's channel scales."""
    def product(x: jax.Array, name: str) -> jax.Array:
        weight, scale = w[name]
        y = jax.lax.ragged_dot(x, weight.astype(x.dtype), group_sizes)
        return y if scale is None else y * scale[sorted_experts].astype(y.dtype)

    h = _activate(product(xs, "gate"), product(xs, "up"), act)
    return product(h, "down")


def tiled_products(xs: jax.Array, sorted_experts: jax.Array, group_sizes: jax.Array,
                   w: ExpertWeights, act: str, m: int) -> jax.Array:
    """The "tiles" form of `ragged_products` (the same `[A, E]` result): each expert's rows
    padded to a multiple of m, then a loop over the non-empty tiles (`[m, E]` each, one
    expert per tile) reading that expert's weights in place."""
    A, E = xs.shape
    X = group_sizes.shape[0]
    tiles = (group_sizes + m - 1) // m
    padded = tiles * m
    padded_start = jnp.cumsum(padded) - padded
    start = jnp.cumsum(group_sizes) - group_sizes
    dest = padded_start[sorted_experts] + jnp.arange(A, dtype=jnp.int32) - start[sorted_experts]
    num_tiles = min((A + X * (m - 1)) // m, A)  # static bound: each non-empty tile has a row
    rows = num_tiles * m
    xp = jnp.zeros((rows, E), xs.dtype).at[dest].set(xs)
    tile_ends = jnp.cumsum(tiles)
    tile_expert = jnp.clip(jnp.searchsorted(tile_ends, jnp.arange(num_tiles), side="right"),
                           0, X - 1)

    def product(x: jax.Array, name: str, e: jax.Array) -> jax.Array:
        weight, scale = w[name]
        y = x @ weight[e].astype(x.dtype)
        return y if scale is None else y * scale[e].astype(y.dtype)

    def body(t, out):
        e = tile_expert[t]
        x = jax.lax.dynamic_slice_in_dim(xp, t * m, m)
        h = _activate(product(x, "gate", e), product(x, "up", e), act)
        return jax.lax.dynamic_update_slice_in_dim(out, product(h, "down", e), t * m, 0)

    out = jax.lax.fori_loop(0, tile_ends[-1], body, jnp.zeros((rows, E), xs.dtype))
    return out[dest]


def expert_mix(x: jax.Array, weights: jax.Array, experts: jax.Array, w: ExpertWeights,
               act: str, form: tuple[str, int] | None = None) -> jax.Array:
    """The routed MLP: `x [T, E]`, each token's `experts [T, k]` and `weights [T, k]` ->
    `[T, E]`, the k experts' outputs summed with their weights. Assignments sorted by
    expert, one grouped product per projection (`form`: `(name, m)`, default
    `dispatch_form`), unsorted, combined in top-k order."""
    T, k = experts.shape
    X = w["gate"][0].shape[0]
    name, m = form or dispatch_form(T * k, X)
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)            # sorted position -> assignment
    sorted_experts = flat[order]
    group_sizes = jnp.zeros((X,), jnp.int32).at[flat].add(1)
    xs = x[order // k]
    if name == "ragged":
        ys = ragged_products(xs, sorted_experts, group_sizes, w, act)
    elif name == "tiles":
        ys = tiled_products(xs, sorted_experts, group_sizes, w, act, m)
    else:
        raise ValueError(f"unknown expert product form {name!r} (forms: {FORMS})")
    y = jnp.zeros_like(ys).at[order].set(ys).reshape(T, k, -1)
    return jnp.sum(y * weights[..., None].astype(y.dtype), axis=1)


class MoE(nnx.Module):
    """The mixture-of-experts MLP of one layer. x: [T, E] -> ([T, E], counts [X] int32)."""

    def __init__(self, cfg: ModelConfig, dtype: jnp.dtype, rngs: nnx.Rngs):
        E, F, X = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts
        self.router = nnx.Param(0.02 * jax.random.normal(rngs.params(), (E, X)).astype(dtype))
        for name, shape in (("gate", (X, E, F)), ("up", (X, E, F)), ("down", (X, F, E))):
            w = 0.02 * jax.random.normal(rngs.params(), shape, jnp.float32)
            if cfg.quantization is None:
                setattr(self, name, nnx.Param(w.astype(dtype)))
            else:
                q, scale = quantize(w.astype(dtype), EXPERT_IN_AXES[name])
                setattr(self, name, nnx.Param(q))
                setattr(self, name + SCALE_SUFFIX, nnx.Param(scale))
        self.top_k = cfg.experts_per_token
        self.normalize = cfg.norm_topk_prob
        self.act = cfg.hidden_act

    def expert_weights(self) -> ExpertWeights:
        """The three projections' `(weight, scale)` (scale None for float weights)."""
        def one(name: str) -> tuple[jax.Array, jax.Array | None]:
            scale = getattr(self, name + SCALE_SUFFIX, None)
            return getattr(self, name)[...], None if scale is None else scale[...]
        return {name: one(name) for name in ("gate", "up", "down")}

    def __call__(self, x: jax.Array, real: jax.Array | None = None,
                 form: tuple[str, int] | None = None) -> tuple[jax.Array, jax.Array]:
        """x [T, E] -> (out [T, E], counts [X] int32: the tokens routed to each expert,
        counting only the `real [T] bool` ones when given); form: see `expert_mix`."""
        logits = x @ self.router[...]
        weights, experts = route(logits, self.top_k, self.normalize)
        out = expert_mix(x, weights, experts, self.expert_weights(), self.act, form)
        return out, expert_counts(experts, self.router.shape[-1], real)


__all__ = ["EXPERT_IN_AXES", "FORMS", "MOE_AXES", "ExpertWeights", "MoE", "dispatch_form",
           "expert_counts", "expert_mix", "ragged_products", "route", "tile_rows",
           "tiled_products"]
