"""Turns canonical tensors (Hugging Face names and [out, in] shapes) into our params pytree.

Every reader (safetensors, GGUF) produces the same canonical dict, so this is the one place
that knows both layouts: HF's per-layer `[out, in]` matrices become stacked `[L, in, ...]`
arrays split by head, as `metrale_jax.models` declares them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from metrale_jax.config import ModelConfig
from metrale_jax.errors import CheckpointError
from metrale_jax.models.quant import SCALE_SUFFIX, quantize_weight, stacked_in_axes
from metrale_jax.models.transformer import abstract_model
from metrale_jax.weights.expert_tensors import expert_tensor, router_tensor


def _layer_specs(cfg: ModelConfig) -> dict[tuple[str, ...], tuple[str, Callable]]:
    """Our per-layer param path -> (HF name pattern, function from the HF tensor to ours)."""
    E, H, K, D = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    p = "model.layers.{i}."
    specs: dict[tuple[str, ...], tuple[str, Callable]] = {
        ("attn", "q_proj"): (p + "self_attn.q_proj.weight", lambda w: w.T.reshape(E, H, D)),
        ("attn", "k_proj"): (p + "self_attn.k_proj.weight", lambda w: w.T.reshape(E, K, D)),
        ("attn", "v_proj"): (p + "self_attn.v_proj.weight", lambda w: w.T.reshape(E, K, D)),
        ("attn", "o_proj"): (p + "self_attn.o_proj.weight", lambda w: w.T.reshape(H, D, E)),
        ("attn_norm", "weight"): (p + "input_layernorm.weight", lambda w: w),
    }
    if not cfg.is_moe:  # a mixture of experts' MLP: `place_experts`
        specs[("mlp", "gate")] = (p + "mlp.gate_proj.weight", lambda w: w.T)
        specs[("mlp", "up")] = (p + "mlp.up_proj.weight", lambda w: w.T)
        specs[("mlp", "down")] = (p + "mlp.down_proj.weight", lambda w: w.T)
    if cfg.post_norms:  # Gemma 2 names its four norms differently from Llama.
        specs[("post_attn_norm", "weight")] = (p + "post_attention_layernorm.weight", lambda w: w)
        specs[("mlp_norm", "weight")] = (p + "pre_feedforward_layernorm.weight", lambda w: w)
        specs[("post_mlp_norm", "weight")] = (p + "post_feedforward_layernorm.weight",
                                              lambda w: w)
    else:
        specs[("mlp_norm", "weight")] = (p + "post_attention_layernorm.weight", lambda w: w)
    if cfg.attention_bias:
        specs[("attn", "q_bias")] = (p + "self_attn.q_proj.bias", lambda b: b.reshape(H, D))
        specs[("attn", "k_bias")] = (p + "self_attn.k_proj.bias", lambda b: b.reshape(K, D))
        specs[("attn", "v_bias")] = (p + "self_attn.v_proj.bias", lambda b: b.reshape(K, D))
    if cfg.qk_norm:
        specs[("attn", "q_norm", "weight")] = (p + "self_attn.q_norm.weight", lambda w: w)
        specs[("attn", "k_norm", "weight")] = (p + "self_attn.k_norm.weight", lambda w: w)
    return specs


FUSED_PROJECTIONS: dict[str, tuple[str, int]] = {
    "self_attn.q_proj.weight": ("self_attn.qkv_proj.weight", 0),
    "self_attn.k_proj.weight": ("self_attn.qkv_proj.weight", 1),
    "self_attn.v_proj.weight": ("self_attn.qkv_proj.weight", 2),
    "mlp.gate_proj.weight": ("mlp.gate_up_proj.weight", 0),
    "mlp.up_proj.weight": ("mlp.gate_up_proj.weight", 1),
}
"""Per-layer HF suffix of a split projection -> (the fused tensor holding it, its part)."""


def unfuse_projections(cfg: ModelConfig, tensors: Mapping[str, np.ndarray],
                       name: str) -> np.ndarray | None:
    """HF tensor `name` cut from the fused projection that holds it (Phi-3's `qkv_proj`
    `[(H + 2K) * D, E]`: rows q, then k, then v; `gate_up_proj` `[2F, E]`: gate, then up),
    or None when `name` is not such a part or no fused tensor is there."""
    prefix, _, suffix = name.partition(".layers.")
    layer, _, suffix = suffix.partition(".")
    if suffix not in FUSED_PROJECTIONS:
        return None
    fused_suffix, part = FUSED_PROJECTIONS[suffix]
    fused_name = f"{prefix}.layers.{layer}.{fused_suffix}"
    if fused_name not in tensors:
        return None
    fused = np.asarray(tensors[fused_name])
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    bounds = ((0, q, q + kv, q + 2 * kv) if suffix.startswith("self_attn")
              else (0, cfg.intermediate_size, 2 * cfg.intermediate_size))
    if fused.shape[0] != bounds[-1]:
        raise CheckpointError(f"tensor {fused_name!r} has {fused.shape[0]} rows, but the "
                              f"config implies {bounds[-1]}")
    return fused[bounds[part]:bounds[part + 1]]


def _set(tree: dict, path: tuple[str, ...], value) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def _get(tree, path: tuple[str, ...]):
    for key in path:
        tree = tree[key]
    return tree


def assemble_params(cfg: ModelConfig, tensors: Mapping[str, np.ndarray], source: Path | str,
                    dtype: jnp.dtype = jnp.float32) -> tuple[nnx.GraphDef, nnx.State]:
    """Builds `(graphdef, params)` for `cfg` from canonical tensors, cast to `dtype`; with
    `cfg.quantization`, the weights it names are quantized (int8 or int4) in numpy as each stacked
    tensor is placed (`models/quant.py`), so no float copy of them reaches the device.

    Raises `CheckpointError` naming `source` and the tensor when one is missing or its shape
    disagrees with the config.
    """
    graphdef, abstract = abstract_model(cfg, dtype)
    want = nnx.to_pure_dict(abstract)
    # The float shapes the checkpoint's tensors have (a quantized weight's may differ).
    float_shapes = (nnx.to_pure_dict(abstract_model(dataclasses.replace(
        cfg, quantization=None), dtype)[1]) if cfg.quantization else want)

    def take(name: str) -> np.ndarray:
        if name not in tensors:
            try:  # Phi-3's qkv_proj, gate_up_proj
                part = unfuse_projections(cfg, tensors, name)
            except CheckpointError as e:
                raise CheckpointError(f"{source}: {e}") from None
            if part is None:
                raise CheckpointError(f"{source}: tensor {name!r} is missing")
            return part
        return np.asarray(tensors[name])

    def place(path: tuple[str, ...], value: np.ndarray, name: str) -> None:
        target, shape = _get(want, path), _get(float_shapes, path).shape
        if tuple(value.shape) != tuple(shape):
            raise CheckpointError(
                f"{source}: tensor {name!r} has shape {tuple(value.shape)}, but the config "
                f"implies {tuple(shape)}")
        if target.dtype in (jnp.int8, jnp.uint8):  # cfg.quantization, on the host
            q, scale = quantize_weight(np.asarray(value, np.float32), stacked_in_axes(path),
                                       cfg.quantization, linear=path[0] == "blocks")
            _set(out, (*path[:-1], path[-1] + SCALE_SUFFIX), jnp.asarray(scale))
            _set(out, path, jnp.asarray(q))
            return
        _set(out, path, jnp.asarray(value, dtype))

    def reshaped(fn: Callable, w: np.ndarray, name: str, path: tuple[str, ...]) -> np.ndarray:
        try:
            return fn(w)
        except ValueError:
            layer_shape = _get(float_shapes, ("blocks", *path)).shape[1:]
            raise CheckpointError(
                f"{source}: tensor {name!r} has shape {tuple(w.shape)}, which does not fit "
                f"the config's {tuple(layer_shape)}") from None

    out: dict = {}
    embed = take("model.embed_tokens.weight")
    place(("embed",), embed, "model.embed_tokens.weight")
    place(("final_norm", "weight"), take("model.norm.weight"), "model.norm.weight")
    if not cfg.tie_word_embeddings:
        head = tensors.get("lm_head.weight")
        head = embed if head is None else np.asarray(head)
        place(("lm_head",), head.T, "lm_head.weight")
    for path, (pattern, fn) in _layer_specs(cfg).items():
        layers = []
        for i in range(cfg.num_layers):
            name = pattern.format(i=i)
            layers.append(reshaped(fn, take(name), name, path))
        place(("blocks", *path), np.stack(layers), pattern.format(i="*"))
    if cfg.is_moe:
        place_experts(cfg, tensors, source, place)
    state = jax.tree.map(lambda x: x, abstract)
    nnx.replace_by_pure_dict(state, out)
    return graphdef, state


def place_experts(cfg: ModelConfig, tensors: Mapping[str, np.ndarray], source: Path | str,
                  place: Callable[[tuple[str, ...], np.ndarray, str], None]) -> None:
    """Places every layer's router `[L, E, X]` and experts (gate / up `[L, X, E, F]`, down
    `[L, X, F, E]`) read by `weights/expert_tensors.py` from whichever form the checkpoint
    holds."""
    routers = [router_tensor(tensors, i, source) for i in range(cfg.num_layers)]
    place(("blocks", "moe", "router"), np.stack([w.T for _, w in routers]),
          routers[0][0].replace(".0.", ".*.", 1))
    for proj in ("gate", "up", "down"):
        layers = [expert_tensor(cfg, tensors, i, proj, source) for i in range(cfg.num_layers)]
        place(("blocks", "moe", proj), np.stack([w for _, w in layers]), layers[0][0])
