"""The vision encoder of a LLaVA-style model: a ViT tower (CLIP or SigLIP) and the projector.

transformers' `LlavaForConditionalGeneration.get_image_features`: the tower runs over
`pixel_values [N, C, H, W]`; the hidden states of `feature_layers` (hidden state 0 is the
embeddings, after CLIP's pre-LayerNorm; hidden state i the output of layer i; never the
post-LayerNorm) are concatenated, the class token dropped for the "default" strategy, and the
two-layer projector maps each position into the text model's embedding space. The result,
`[N, tokens_per_image, E_text]`, replaces the image placeholder tokens' embeddings in the
prompt.

The tower's layers are the pre-norm encoder layers of `models/m2m100.py` (LayerNorm,
biased multi-head attention, FFN), stacked `[L, ...]` and run with `lax.scan`.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from metrale_jax.families.llava import VisionConfig
from metrale_jax.models.layers import AxesTable, random_param, stacked_axes, stacked_modules
from metrale_jax.models.m2m100 import (
    ATTENTION_AXES,
    FFN_AXES,
    NORM_AXES,
    FeedForward,
    LayerNorm,
    MultiHeadAttention,
    activation,
)


class VisionLayer(nnx.Module):
    """Pre-norm ViT layer: `x + attn(ln1(x))`, then `x + mlp(ln2(x))`; x `[N, P, E]`."""

    def __init__(self, cfg: VisionConfig, dtype: Any, rngs: nnx.Rngs):
        E, eps = cfg.hidden_size, cfg.layer_norm_eps
        self.attn_norm = LayerNorm(E, eps, dtype)
        self.attn = MultiHeadAttention(E, cfg.num_heads, dtype, rngs)
        self.mlp_norm = LayerNorm(E, eps, dtype)
        self.mlp = FeedForward(E, cfg.intermediate_size, cfg.hidden_act, dtype, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        """x `[N, P, E]` -> `[N, P, E]` (every position attends to every other)."""
        h = self.attn_norm(x)
        k, v = self.attn.key_value(h)
        full = jnp.ones((1, 1, x.shape[1]), bool)
        x = x + self.attn.attend(self.attn.query(h), [k], [v], [full])
        return x + self.mlp(self.mlp_norm(x))


class VisionEncoder(nnx.Module):
    """The tower and the projector: `pixel_values [N, C, H, W]` (H = W = image_size, the
    image processor's output) -> image features `[N, tokens_per_image, E_text]`.

    Params (`nnx.to_pure_dict` keys): `patch_embed [p, p, C, E]` (and `patch_bias [E]` for
    SigLIP), `class_embed [E]` (CLIP), `position_embed [positions, E]`, `pre_norm` (CLIP),
    `layers` (stacked `[L, ...]`), `proj_1 [F * E, E_text]`, `proj_1_bias`, `proj_2
    [E_text, E_text]`, `proj_2_bias` (F: the number of feature layers).
    """

    def __init__(self, cfg: VisionConfig, dtype: Any = jnp.float32, *, rngs: nnx.Rngs):
        self.cfg = cfg
        E, p, C, T = cfg.hidden_size, cfg.patch_size, cfg.num_channels, cfg.text_hidden_size
        self.patch_embed = random_param(rngs, (p, p, C, E), dtype)
        if cfg.tower == "siglip":
            self.patch_bias = nnx.Param(jnp.zeros((E,), dtype))
        else:
            self.class_embed = random_param(rngs, (E,), dtype)
            self.pre_norm = LayerNorm(E, cfg.layer_norm_eps, dtype)
        self.position_embed = random_param(rngs, (cfg.num_positions, E), dtype)
        self.layers = stacked_modules(lambda r: VisionLayer(cfg, dtype, r), cfg.num_layers, rngs)
        F = len(cfg.feature_layers)
        self.proj_1 = random_param(rngs, (F * E, T), dtype)
        self.proj_2 = random_param(rngs, (T, T), dtype)
        if cfg.projector_bias:
            self.proj_1_bias = nnx.Param(jnp.zeros((T,), dtype))
            self.proj_2_bias = nnx.Param(jnp.zeros((T,), dtype))

    def embed(self, pixel_values: jax.Array) -> jax.Array:
        """Patch, class and position embeddings: `[N, C, H, W]` -> `[N, positions, E]` (after
        CLIP's pre-LayerNorm): hidden state 0."""
        cfg = self.cfg
        w = self.patch_embed[...]
        x = jnp.transpose(pixel_values.astype(w.dtype), (0, 2, 3, 1))  # NHWC
        x = jax.lax.conv_general_dilated(
            x, w, window_strides=(cfg.patch_size, cfg.patch_size), padding="VALID",
            dimension_numbers=("NHWC", "HWIO", "NHWC"),
            precision=jax.lax.Precision.HIGHEST)
        N = x.shape[0]
        x = x.reshape(N, -1, cfg.hidden_size)
        if cfg.tower == "siglip":
            x = x + self.patch_bias[...]
        else:
            cls = jnp.broadcast_to(self.class_embed[...], (N, 1, cfg.hidden_size))
            x = jnp.concatenate([cls.astype(x.dtype), x], axis=1)
        x = x + self.position_embed[...][None]
        return self.pre_norm(x) if cfg.tower == "clip" else x

    def hidden_states(self, pixel_values: jax.Array) -> list[jax.Array]:
        """The tower's hidden states of `feature_layers`, in their order: each `[N, P, E]`.
        Only the layers up to the deepest one asked for run."""
        cfg = self.cfg
        wanted = [layer % (cfg.num_layers + 1) for layer in cfg.feature_layers]
        depth = max(wanted)
        x0 = self.embed(pixel_values)
        if depth == 0:
            return [x0 for _ in wanted]
        layer_def, layer_state = nnx.split(self.layers)
        layer_state = jax.tree.map(lambda a: a[:depth], layer_state)

        def body(x, state):
            y = nnx.merge(layer_def, state)(x)
            return y, y

        _, ys = jax.lax.scan(body, x0, layer_state)
        return [x0 if i == 0 else ys[i - 1] for i in wanted]

    def __call__(self, pixel_values: jax.Array) -> jax.Array:
        """`pixel_values [N, C, H, W]` -> image features `[N, tokens_per_image, E_text]`."""
        cfg = self.cfg
        hs = self.hidden_states(pixel_values)
        if cfg.select_strategy == "default":
            hs = [h[:, 1:] for h in hs]
        x = jnp.concatenate(hs, axis=-1) if len(hs) > 1 else hs[0]
        x = x @ self.proj_1[...]
        if cfg.projector_bias:
            x = x + self.proj_1_bias[...]
        x = activation(cfg.projector_act, x) @ self.proj_2[...]
        if cfg.projector_bias:
            x = x + self.proj_2_bias[...]
        return x


# ---- logical axes (engine/sharding.py's vocabulary) ----------------------------------------

def vision_axes(cfg: VisionConfig) -> AxesTable:
    """Logical axes of every `VisionEncoder` param, keyed like `nnx.to_pure_dict(params)`:
    heads and the MLP on the model axis, like the text model's."""
    table: AxesTable = {
        "patch_embed": (None, None, None, "embed"),
        "position_embed": (None, "embed"),
        "layers": stacked_axes({"attn_norm": NORM_AXES, "attn": ATTENTION_AXES,
                                "mlp_norm": NORM_AXES, "mlp": FFN_AXES}),
        "proj_1": ("embed", "mlp"), "proj_2": ("mlp", "embed"),
    }
    if cfg.tower == "siglip":
        table["patch_bias"] = ("embed",)
    else:
        table["class_embed"] = ("embed",)
        table["pre_norm"] = NORM_AXES
    if cfg.projector_bias:
        table["proj_1_bias"] = ("mlp",)
        table["proj_2_bias"] = ("embed",)
    return table


def abstract_vision(cfg: VisionConfig,
                    dtype: Any = jnp.float32) -> tuple[nnx.GraphDef, nnx.State]:
    """The vision encoder's graphdef and a params pytree of `jax.ShapeDtypeStruct`s."""
    model = nnx.eval_shape(lambda: VisionEncoder(cfg, dtype, rngs=nnx.Rngs(0)))
    return nnx.split(model)


def encode_images(graphdef: nnx.GraphDef, params: nnx.State,
                  pixel_values: jax.Array) -> jax.Array:
    """The pure vision forward: `pixel_values [N, C, H, W]` -> `[N, tokens_per_image,
    E_text]` in the params dtype."""
    return nnx.merge(graphdef, params)(pixel_values)


__all__ = ["VisionEncoder", "VisionLayer", "abstract_vision", "encode_images", "vision_axes"]
