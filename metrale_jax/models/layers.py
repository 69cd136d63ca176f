"""The building blocks shared by every model family: RMSNorm, RoPE, attention and the gated MLP.

Each block is a Flax NNX module whose parameters use the [in, out] layout JAX prefers
(`q_proj: [E, H, D]`), so that a checkpoint in Hugging Face's [out, in] layout is transposed once
at load time (`metrale_jax.weights.assemble`), never per step.

Compute convention: activations run in the params dtype (float32 on CPU, bfloat16 on TPU/GPU);
norms, softmax and logits run in float32.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from metrale_jax.config import ModelConfig, RopeScaling
from metrale_jax.models.quant import (
    ATTENTION_LINEAR,
    MLP_LINEAR,
    SCALE_SUFFIX,
    qeinsum,
    qmatmul,
    quantize_weight,
    scale_axes,
)


def random_param(rngs: nnx.Rngs, shape: tuple[int, ...], dtype: jnp.dtype,
                 std: float = 0.02) -> nnx.Param:
    """A parameter of `shape` drawn from N(0, std²) in float32, stored in `dtype`."""
    return nnx.Param(std * jax.random.normal(rngs.params(), shape, jnp.float32).astype(dtype))


def stacked_modules(make: Callable[[nnx.Rngs], nnx.Module], n: int,
                    rngs: nnx.Rngs) -> nnx.Module:
    """`n` modules built by `make` as one module whose every parameter has a leading `L`
    axis of size n (each layer drawn from its own split of `rngs`)."""
    @nnx.split_rngs(splits=n)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def build(r: nnx.Rngs) -> nnx.Module:
        return make(r)

    return build(rngs)


def init_linear(module: nnx.Module, name: str, rngs: nnx.Rngs, shape: tuple[int, ...],
                n_in: int, dtype: jnp.dtype, quantization: str | None) -> None:
    """Sets `module.<name>`, a random linear weight of `shape` (its first `n_in` axes the
    input ones), stored as `quantization` says: None float; "int8" / "int8-all" int8 with
    its float32 scale `module.<name>_scale` (shape: the output axes), see `models/quant.py`;
    "int4" packed 4-bit codes `[out..., in / 2]` with block scales `[out..., in / 32, 2]`
    (`models/quant4.py`)."""
    w = random_param(rngs, shape, dtype)
    if quantization is None:
        setattr(module, name, w)
        return
    q, scale = quantize_weight(w[...], tuple(range(n_in)), quantization)
    setattr(module, name, nnx.Param(q))
    setattr(module, name + SCALE_SUFFIX, nnx.Param(scale))


def linear_weight(module: nnx.Module, name: str) -> tuple[jax.Array, jax.Array | None]:
    """`(weight, scale)` of linear weight `name` of `module`: scale None for a float weight,
    the per-output-channel scale of an int8 one, the block scales of an int4 one."""
    scale = getattr(module, name + SCALE_SUFFIX, None)
    return getattr(module, name)[...], None if scale is None else scale[...]


class RMSNorm(nnx.Module):
    """Root-mean-square norm over the last axis: `x / rms(x) * w` (or `* (1 + w)` for Gemma).

    x: [..., N] -> [..., N], same dtype; the statistics are computed in float32.
    """

    def __init__(self, size: int, eps: float, offset: bool, dtype: jnp.dtype):
        self.eps = eps
        self.offset = offset
        init = jnp.zeros if offset else jnp.ones
        self.weight = nnx.Param(init((size,), dtype))

    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_norm(x, self.weight[...], self.eps, self.offset)


LogicalAxes = tuple[str | None, ...]
"""One logical axis name per dimension of an array (None: never sharded)."""

AxesTable = dict[str, "LogicalAxes | AxesTable"]
"""Logical axes of a module's params, keyed like its `nnx.to_pure_dict` (nested per submodule)."""


def stacked_axes(table: AxesTable, axis: str = "layers") -> AxesTable:
    """`table` with `axis` prepended to every entry: the axes of params stacked `[L, ...]`."""
    return {k: stacked_axes(v, axis) if isinstance(v, dict) else (axis, *v)
            for k, v in table.items()}


# Logical axes of each module's params, beside the shapes above: engine/sharding.py maps them
# to mesh axes. A new parameter needs its entry here (sharding fails loudly on a missing one).
NORM_AXES: AxesTable = {"weight": ("embed",)}
HEAD_NORM_AXES: AxesTable = {"weight": ("head_dim",)}  # q_norm / k_norm (Qwen3) norm over D


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, offset: bool) -> jax.Array:
    """`x / rms(x) * w` (or `* (1 + w)` when `offset`) over the last axis; x: [..., N],
    weight: [N]; statistics in float32, result in x's dtype."""
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    if offset:  # Gemma scales in float32 and casts once, at the end.
        return (x32 * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)
    return weight.astype(x.dtype) * x32.astype(x.dtype)


def embed_tokens(cfg: ModelConfig, embed: jax.Array, tokens: jax.Array,
                 images: tuple[jax.Array, jax.Array] | None = None,
                 scale: jax.Array | None = None) -> jax.Array:
    """Token embeddings `[..., E]` of `tokens` from `embed: [V, E]` (scaled by sqrt(E) for
    Gemma). images: `(rows [...] int32, pool [P, E])`: a token whose row is >= 0 takes that
    row of the image feature pool instead (before Gemma's scaling, as transformers' LLaVA
    splices image features into the inputs embeddings). scale: `[V]`, the row scales of an
    int8 `embed` (the result then has the scale's dtype)."""
    x = embed[tokens]
    if scale is not None:
        x = x.astype(scale.dtype) * scale[tokens][..., None]
    if images is not None:
        rows, pool = images
        picked = pool[jnp.clip(rows, 0, pool.shape[0] - 1)].astype(x.dtype)
        x = jnp.where((rows >= 0)[..., None], picked, x)
    if cfg.embed_scale:
        x = x * jnp.asarray(cfg.hidden_size**0.5, x.dtype)
    return x


def lm_logits(cfg: ModelConfig, x: jax.Array, embed: jax.Array,
              lm_head: jax.Array | None, embed_scale: jax.Array | None = None,
              head_scale: jax.Array | None = None) -> jax.Array:
    """Normalised hidden states `x: [..., E]` -> logits `[..., V] float32`: the LM head
    (`lm_head: [E, V]`, or the tied `embed: [V, E]`) and the final soft-cap. embed_scale,
    head_scale: `[V]`, the scales of an int8 embed / lm_head (None: float)."""
    if cfg.tie_word_embeddings:
        logits = qeinsum("...e,ve->...v", x, embed, embed_scale)
    else:
        logits = qmatmul(x, lm_head, head_scale)
    logits = logits.astype(jnp.float32)
    if cfg.final_logit_softcap:
        logits = cfg.final_logit_softcap * jnp.tanh(logits / cfg.final_logit_softcap)
    return logits


def rope_inverse_frequencies(head_dim: int, theta: float,
                             scaling: RopeScaling | None) -> np.ndarray:
    """The RoPE inverse frequencies `[R // 2] float32` of the `R` rotated dimensions of a head
    (`R = D`, or `D * scaling.partial_rotary_factor`), with `scaling` applied as transformers'
    `modeling_rope_utils` computes it:

    "linear" divides every frequency by the factor; "llama3" divides the low frequencies by it,
    keeps the high ones and interpolates smoothly between (Llama 3.1's scheme); "dynamic"
    (NTK) raises the base to `theta * (factor^2 - factor + 1)^(R / (R - 2))`, the base
    transformers uses at `factor` x its positions, fixed (a paged cache cannot re-rotate the
    keys it holds as a sequence grows; vLLM's choice); "yarn" blends interpolated
    (`/ factor`) and original frequencies along a ramp over the dimensions whose wavelengths
    make `beta_fast` .. `beta_slow` turns in `original_max_position_embeddings`; "longrope"
    divides frequency i by `long_factor[i]` when `long_context` else `short_factor[i]`. The
    attention factor (yarn, longrope) is `rope_attention_factor`'s, applied by `apply_rope`.
    """
    rot = head_dim if scaling is None else int(head_dim * scaling.partial_rotary_factor)
    kind = "default" if scaling is None else scaling.kind
    if kind in ("dynamic", "yarn", "longrope"):  # transformers computes these in float32
        return _float32_inverse_frequencies(rot, theta, scaling)
    inv_freq = 1.0 / (theta ** (np.arange(0, rot, 2, dtype=np.float64) / rot))
    if kind == "default":
        return inv_freq.astype(np.float32)
    if kind == "linear":
        return (inv_freq / scaling.factor).astype(np.float32)
    old_len = scaling.original_max_position_embeddings
    low_wavelen = old_len / scaling.low_freq_factor
    high_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def _float32_inverse_frequencies(rot: int, theta: float, scaling: RopeScaling) -> np.ndarray:
    """"dynamic", "yarn" and "longrope" frequencies `[rot // 2] float32`, in transformers'
    float32 arithmetic (see `rope_inverse_frequencies`)."""
    exponents = np.arange(0, rot, 2, dtype=np.float32) / np.float32(rot)
    factor = scaling.factor
    if scaling.kind == "dynamic":
        base = theta * (factor * factor - factor + 1) ** (rot / (rot - 2))
        return (1.0 / np.power(np.float32(base), exponents)).astype(np.float32)
    pos_freqs = np.power(np.float32(theta), exponents)
    if scaling.kind == "longrope":
        ext = scaling.long_factor if scaling.long_context else scaling.short_factor
        return (1.0 / (np.asarray(ext, np.float32) * pos_freqs)).astype(np.float32)

    def correction_dim(rotations: float) -> float:  # the dimension making `rotations` turns
        old_len = scaling.original_max_position_embeddings
        return rot * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rot - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = np.clip((np.arange(rot // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    extrapolation = (1 - ramp).astype(np.float32)
    inv_extra = 1.0 / pos_freqs
    inv_inter = 1.0 / (np.float32(factor) * pos_freqs)
    return (inv_inter * (1 - extrapolation) + inv_extra * extrapolation).astype(np.float32)


def rope_attention_factor(scaling: RopeScaling | None) -> float:
    """The factor cos and sin are multiplied by (1.0 unless yarn or longrope set one)."""
    return 1.0 if scaling is None else scaling.attention_factor


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray,
               attention_factor: float = 1.0) -> jax.Array:
    """Rotates `x: [B, T, N, D]` by `positions: [B, T] int32` (HF's rotate-half convention)
    over its first `R = 2 * len(inv_freq)` dimensions (`inv_freq: [R / 2]`; the other
    `D - R` pass through: partial rotary), cos and sin multiplied by `attention_factor`."""
    angles = positions.astype(jnp.float32)[:, :, None] * jnp.asarray(inv_freq)  # [B, T, R/2]
    cos = jnp.cos(angles)[:, :, None, :]
    sin = jnp.sin(angles)[:, :, None, :]
    if attention_factor != 1.0:
        cos, sin = cos * attention_factor, sin * attention_factor
    rot = 2 * angles.shape[-1]
    half = rot // 2
    x1 = x[..., :half].astype(jnp.float32)
    x2 = x[..., half:rot].astype(jnp.float32)
    parts = [x1 * cos - x2 * sin, x2 * cos + x1 * sin]
    if rot < x.shape[-1]:
        parts.append(x[..., rot:].astype(jnp.float32))
    return jnp.concatenate(parts, axis=-1).astype(x.dtype)


LoraDelta = Callable[[str, jax.Array], jax.Array]
"""`delta(module, x)`: the LoRA update `[..., out]` of Hugging Face-named projection `module`
(q_proj ... down_proj) for its input `x: [..., in]`, each token with its own adapter (zeros
for a token without one). Built by `models/lora.py`."""


class MLP(nnx.Module):
    """Gated MLP: `down(act(x @ gate) * (x @ up))`. x: [B, T, E] -> [B, T, E]."""

    def __init__(self, cfg: ModelConfig, dtype: jnp.dtype, rngs: nnx.Rngs):
        E, F = cfg.hidden_size, cfg.intermediate_size
        for name, shape in (("gate", (E, F)), ("up", (E, F)), ("down", (F, E))):
            init_linear(self, name, rngs, shape, MLP_LINEAR[name], dtype, cfg.quantization)
        self.act = cfg.hidden_act

    def __call__(self, x: jax.Array, lora: LoraDelta | None = None) -> jax.Array:
        """lora: adds each projection's per-token adapter update (see `LoraDelta`). Int8
        weights (`models/quant.py`) are scaled per output channel after each product."""
        gate = qmatmul(x, *linear_weight(self, "gate"))
        up = qmatmul(x, *linear_weight(self, "up"))
        if lora is not None:
            gate, up = gate + lora("gate_proj", x), up + lora("up_proj", x)
        gate = jax.nn.silu(gate) if self.act == "silu" else jax.nn.gelu(gate, approximate=True)
        h = gate * up
        out = qmatmul(h, *linear_weight(self, "down"))
        return out if lora is None else out + lora("down_proj", h)


# With the scales of int8 weights: each takes its weight's output axes (gate_scale ("mlp",)).
MLP_AXES: AxesTable = scale_axes(
    {"gate": ("embed", "mlp"), "up": ("embed", "mlp"), "down": ("mlp", "embed")}, MLP_LINEAR)


class Attention(nnx.Module):
    """Grouped-query attention's params and projections: `qkv` (q, k and v with RoPE) and
    `project_out` (o_proj). The attention over the paged cache between them is
    `models/ragged.py`'s.
    """

    def __init__(self, cfg: ModelConfig, dtype: jnp.dtype, rngs: nnx.Rngs):
        E, H, K, D = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.cfg = cfg
        for name, shape in (("q_proj", (E, H, D)), ("k_proj", (E, K, D)),
                            ("v_proj", (E, K, D)), ("o_proj", (H, D, E))):
            init_linear(self, name, rngs, shape, ATTENTION_LINEAR[name], dtype,
                        cfg.quantization)
        if cfg.attention_bias:
            self.q_bias = nnx.Param(jnp.zeros((H, D), dtype))
            self.k_bias = nnx.Param(jnp.zeros((K, D), dtype))
            self.v_bias = nnx.Param(jnp.zeros((K, D), dtype))
        if cfg.qk_norm:
            self.q_norm = RMSNorm(D, cfg.rms_norm_eps, cfg.norm_weight_offset, dtype)
            self.k_norm = RMSNorm(D, cfg.rms_norm_eps, cfg.norm_weight_offset, dtype)

    def qkv(self, x: jax.Array, positions: jax.Array, lora: LoraDelta | None = None,
            sliding: bool = False) -> tuple[jax.Array, jax.Array, jax.Array]:
        """x [B, T, E], positions [B, T] int32 -> q [B, T, H, D], k and v [B, T, K, D], RoPE
        applied to q and k; lora: adds the per-token adapter updates of q, k and v (see
        `LoraDelta`); sliding: the layer is a sliding-window one (its RoPE base is
        `rope_local_theta` where the config has one)."""
        cfg = self.cfg
        q = qeinsum("bte,ehd->bthd", x, *linear_weight(self, "q_proj"))
        k = qeinsum("bte,ekd->btkd", x, *linear_weight(self, "k_proj"))
        v = qeinsum("bte,ekd->btkd", x, *linear_weight(self, "v_proj"))
        if lora is not None:
            q = q + lora("q_proj", x).reshape(q.shape)
            k = k + lora("k_proj", x).reshape(k.shape)
            v = v + lora("v_proj", x).reshape(v.shape)
        if cfg.attention_bias:
            q, k, v = q + self.q_bias[...], k + self.k_bias[...], v + self.v_bias[...]
        if cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        theta, scaling = cfg.rope_theta, cfg.rope_scaling
        if sliding and cfg.rope_local_theta is not None:
            theta, scaling = cfg.rope_local_theta, None
        inv_freq = rope_inverse_frequencies(cfg.head_dim, theta, scaling)
        factor = rope_attention_factor(scaling)
        q = apply_rope(q, positions, inv_freq, factor)
        k = apply_rope(k, positions, inv_freq, factor)
        return q, k, v

    def project_out(self, out: jax.Array) -> jax.Array:
        """Attention output `[..., H * D]` (heads flattened) -> `[..., E]` through o_proj,
        as one `[H*D, E]` matmul: an einsum over (h, d) makes XLA:CPU transpose o_proj every
        step."""
        o_proj, scale = linear_weight(self, "o_proj")
        if o_proj.dtype == jnp.uint8:  # int4, stored [E, H * D / 2] (models/quant4.py)
            return qmatmul(out, o_proj, scale)
        return qmatmul(out, o_proj.reshape(-1, o_proj.shape[-1]), scale)


ATTENTION_AXES: AxesTable = scale_axes({
    "q_proj": ("embed", "heads", "head_dim"),      # [E, H, D]
    "k_proj": ("embed", "kv_heads", "head_dim"),   # [E, K, D]
    "v_proj": ("embed", "kv_heads", "head_dim"),   # [E, K, D]
    "o_proj": ("heads", "head_dim", "embed"),      # [H, D, E]
    "q_bias": ("heads", "head_dim"),               # [H, D]
    "k_bias": ("kv_heads", "head_dim"),            # [K, D]
    "v_bias": ("kv_heads", "head_dim"),            # [K, D]
    "q_norm": HEAD_NORM_AXES,
    "k_norm": HEAD_NORM_AXES,
}, ATTENTION_LINEAR)  # with the scales of int8 weights (q_proj_scale ("heads", "head_dim"))
