"""What llama.cpp's GGUF names mean: metadata keys -> `ModelConfig`, tensor names -> HF names.

`gguf_reader` opens the file and dequantizes; this module holds the facts about llama.cpp's
conversion (`convert_hf_to_gguf.py`) that turn a GGUF back into canonical tensors:

- tensor names: `blk.{i}.attn_q.weight` is `model.layers.{i}.self_attn.q_proj.weight`, and so on
  (`TENSOR_NAMES` in `gguf.constants`); a family whose names differ (Gemma 2's four norms)
  declares its own in `metrale_jax.families`.
- config: `{arch}.block_count`, `{arch}.attention.head_count`, ... with llama.cpp's defaults
  where a key is optional (rope base 10000); the family (found by `general.architecture`)
  adds its layer graph and reads its own keys (Gemma 2's soft-caps and window).
- Llama 3 RoPE: llama.cpp stores the per-frequency divisors as the `rope_freqs.weight` tensor
  instead of metadata; `llama3_rope_scaling` recovers transformers' four parameters from it.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from metrale_jax.config import ModelConfig, RopeScaling
from metrale_jax.errors import CheckpointError, UnsupportedModelError
from metrale_jax.families import GgufMetadata, family_of_config, family_of_gguf
from metrale_jax.families.registry import BY_GGUF_ARCHITECTURE

SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(BY_GGUF_ARCHITECTURE)
"""The GGUF `general.architecture`s we read (the families that declare one)."""

# Whole-model tensors: GGUF name -> HF name.
GLOBAL_TENSORS: dict[str, str] = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}

# Per-layer tensors: GGUF suffix after `blk.{i}.` -> HF suffix after `model.layers.{i}.`.
LAYER_TENSORS: dict[str, str] = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}

# Tensors llama.cpp may write that have no HF parameter (handled or ignored by the reader).
ROPE_FREQS = "rope_freqs.weight"
ROPE_FACTORS_LONG = "rope_factors_long.weight"   # Phi-3's LongRoPE divisors, `[R / 2]`
ROPE_FACTORS_SHORT = "rope_factors_short.weight"
ROPE_TABLES: tuple[str, ...] = (ROPE_FREQS, ROPE_FACTORS_LONG, ROPE_FACTORS_SHORT)
"""Whole-model RoPE tensors: read into the config (`RopeScaling`), not params."""
IGNORED_LAYER_SUFFIXES: tuple[str, ...] = ("attn_rot_embd.weight",)  # old rotary inv_freq


@functools.cache
def layer_table(arch: str) -> dict[str, str]:
    """The per-layer GGUF-suffix -> HF-suffix table for `arch` (a `ModelConfig.architecture`):
    the shared one with the family's `gguf_layer_tensors` over it. Do not modify it."""
    return {**LAYER_TENSORS, **family_of_config(arch).gguf_layer_tensors}


def hf_name(gguf_name: str, arch: str) -> str | None:
    """The HF parameter name of GGUF tensor `gguf_name`, or None for a name we do not know."""
    if gguf_name in GLOBAL_TENSORS:
        return GLOBAL_TENSORS[gguf_name]
    if gguf_name.startswith("blk."):
        _, layer, suffix = gguf_name.split(".", 2)
        if layer.isdigit() and suffix in layer_table(arch):
            return f"model.layers.{int(layer)}.{layer_table(arch)[suffix]}"
    return None


def expected_shapes(cfg: ModelConfig) -> tuple[dict[str, tuple[int, ...]], set[str]]:
    """HF-named shapes implied by `cfg`: `(shapes, optional)`.

    `shapes` maps every parameter the config calls for to its HF shape (`[out, in]` for
    projections, `[E]` or `[D]` for norms; a mixture of experts' stacked `[X, out, in]`,
    `weights/expert_tensors.py`); `optional` names the ones a file may omit
    (`lm_head.weight` when embeddings are tied).
    """
    V, E, F = cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size
    H, K, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (V, E),
        "model.norm.weight": (E,),
        "lm_head.weight": (V, E),
    }
    fused = family_of_config(cfg.architecture).fused_projections
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        if fused:  # Phi-3: q/k/v and gate/up as one tensor each (split by weights/assemble)
            shapes.update({p + "self_attn.qkv_proj.weight": ((H + 2 * K) * D, E),
                           p + "mlp.gate_up_proj.weight": (2 * F, E)})
        shapes.update({
            p + "input_layernorm.weight": (E,),
            p + "post_attention_layernorm.weight": (E,),
            p + "self_attn.q_proj.weight": (H * D, E),
            p + "self_attn.k_proj.weight": (K * D, E),
            p + "self_attn.v_proj.weight": (K * D, E),
            p + "self_attn.o_proj.weight": (E, H * D),
        })
        if cfg.is_moe:  # llama.cpp's stacked experts `[X, out, in]` and the router `[X, E]`
            X, FX = cfg.num_experts, cfg.moe_intermediate_size
            shapes.update({p + "mlp.gate.weight": (X, E),
                           p + "mlp.experts.gate_proj.weight": (X, FX, E),
                           p + "mlp.experts.up_proj.weight": (X, FX, E),
                           p + "mlp.experts.down_proj.weight": (X, E, FX)})
        else:
            shapes.update({p + "mlp.gate_proj.weight": (F, E),
                           p + "mlp.up_proj.weight": (F, E),
                           p + "mlp.down_proj.weight": (E, F)})
        if fused:
            for name in ("q_proj", "k_proj", "v_proj"):
                del shapes[p + f"self_attn.{name}.weight"]
            del shapes[p + "mlp.gate_proj.weight"], shapes[p + "mlp.up_proj.weight"]
        if cfg.attention_bias:
            shapes.update({p + "self_attn.q_proj.bias": (H * D,),
                           p + "self_attn.k_proj.bias": (K * D,),
                           p + "self_attn.v_proj.bias": (K * D,)})
        if cfg.qk_norm:
            shapes.update({p + "self_attn.q_norm.weight": (D,),
                           p + "self_attn.k_norm.weight": (D,)})
        if cfg.post_norms:
            shapes.update({p + "pre_feedforward_layernorm.weight": (E,),
                           p + "post_feedforward_layernorm.weight": (E,)})
    optional = {"lm_head.weight"} if cfg.tie_word_embeddings else set()
    return shapes, optional


END_OF_TURN_TEXTS = ("<end_of_turn>", "<|eot_id|>")
"""Tokens that end a turn, found by their text when the file names no end-of-turn id (as
llama.cpp's vocabulary does: Gemma's `<end_of_turn>`, Llama 3's `<|eot_id|>`)."""


def _eos_ids(meta: Mapping[str, Any]) -> tuple[int, ...]:
    """eos, then end-of-turn and end-of-message ids: llama.cpp stops on all of them."""
    ids: list[int] = []
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                "tokenizer.ggml.eom_token_id"):
        value = meta.get(key)
        if isinstance(value, int) and value >= 0 and value not in ids:
            ids.append(value)
    tokens = meta.get("tokenizer.ggml.tokens")
    if "tokenizer.ggml.eot_token_id" not in meta and isinstance(tokens, list):
        for text in END_OF_TURN_TEXTS:
            try:
                found = tokens.index(text)
            except ValueError:
                continue
            if found not in ids:
                ids.append(found)
    return tuple(ids)


def llama3_rope_scaling(freq_factors: np.ndarray, theta: float, rot_dim: int,
                        path: Path) -> RopeScaling | None:
    """Recovers Llama 3.1-style RoPE scaling from llama.cpp's `rope_freqs.weight`.

    `freq_factors: [rot_dim // 2] float32` is what `convert_hf_to_gguf.py` writes: for each
    frequency, the number llama.cpp divides it by (1 for short wavelengths, `factor` for long
    ones, a smooth blend between). The converter assumed `original_max_position_embeddings` =
    8192 (its default; Llama 3.1 and 3.2 use 8192), so we assume it too and fit the low/high
    frequency factors to the blended entries. Returns None when every divisor is 1. Raises
    `UnsupportedModelError` when the table is not one that Llama 3's formula produces.
    """
    r = np.asarray(freq_factors, dtype=np.float64).reshape(-1)
    if r.shape[0] != rot_dim // 2:
        raise CheckpointError(f"{path}: {ROPE_FREQS} has {r.shape[0]} entries, expected "
                              f"{rot_dim // 2} (half the rotary dimension)")
    if not np.all(np.isfinite(r)) or np.any(r <= 0):
        raise CheckpointError(f"{path}: {ROPE_FREQS} holds non-positive or non-finite values")
    factor = float(r.max())
    if np.allclose(r, 1.0):
        return None
    old_len = 8192
    freqs = 1.0 / (theta ** (np.arange(0, rot_dim, 2, dtype=np.float32) / rot_dim))
    freqs = freqs.astype(np.float32).astype(np.float64)
    wavelen = 2 * math.pi / freqs
    blended = (r > 1 + 1e-6) & (r < factor * (1 - 1e-6))
    low, high = 1.0, 4.0
    if blended.sum() >= 2 and factor > 1:
        smooth = (1 / r[blended] - 1 / factor) / (1 - 1 / factor)
        a, b = np.polyfit(old_len / wavelen[blended], smooth, 1)  # smooth = (x - low)/(high-low)
        if a > 0:
            low = round(float(-b / a), 4)
            high = round(float(low + 1 / a), 4)
    scaling = RopeScaling("llama3", factor=round(factor, 6), low_freq_factor=low,
                          high_freq_factor=high, original_max_position_embeddings=old_len)
    if not np.allclose(llama3_freq_factors(scaling, theta, rot_dim), r, rtol=1e-4, atol=1e-6):
        raise UnsupportedModelError(
            f"{path}: {ROPE_FREQS} is not a Llama 3 RoPE scaling table that Metrale-JAX can "
            "reproduce (custom per-frequency factors are not supported)")
    return scaling


def llama3_freq_factors(scaling: RopeScaling, theta: float, rot_dim: int) -> np.ndarray:
    """The `[rot_dim // 2] float32` divisor table llama.cpp's converter writes for `scaling`."""
    freqs = 1.0 / (theta ** (np.arange(0, rot_dim, 2, dtype=np.float32) / rot_dim))
    wavelen = 2 * math.pi / freqs.astype(np.float32).astype(np.float64)
    old_len = scaling.original_max_position_embeddings
    low_wl = old_len / scaling.low_freq_factor
    high_wl = old_len / scaling.high_freq_factor
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor)
    blend = 1 / ((1 - smooth) / scaling.factor + smooth)
    out = np.where(wavelen < high_wl, 1.0, np.where(wavelen > low_wl, scaling.factor, blend))
    return out.astype(np.float32)


def gguf_rope_scaling(m: GgufMetadata, partial: float, rope_freqs: np.ndarray | None,
                      rope_factors: tuple[np.ndarray, np.ndarray] | None, theta: float,
                      rot_dim: int) -> RopeScaling | None:
    """The `RopeScaling` of a GGUF file, as llama.cpp applies its metadata: Llama 3's
    `rope_freqs` table (`llama3_rope_scaling`); Phi-3's LongRoPE factor tensors with
    `rope.scaling.attn_factor` (derived from the context lengths when absent) and long factors
    when `context_length` exceeds `rope.scaling.original_context_length` (llama.cpp and vLLM's
    rule); `rope.scaling.type` "linear" or "yarn" (`rope.scaling.factor`,
    `original_context_length`, `yarn_beta_fast` / `yarn_beta_slow`; the attention factor is
    `attn_factor` (default 1) x YaRN's `0.1 ln(factor) + 1`, as llama.cpp computes it);
    `partial` (`rope.dimension_count / D`) below 1 alone is a "default" scaling."""
    path = m.path
    kind = str(m.get(m.key("rope.scaling.type"), "none")).lower()
    shared = {"partial_rotary_factor": partial}
    context = m.integer("context_length", 2048)
    original = m.integer("rope.scaling.original_context_length", context)
    if rope_freqs is not None:
        scaling = llama3_rope_scaling(rope_freqs, theta, rot_dim, path)
        return None if scaling is None else dataclasses.replace(scaling, **shared)
    if rope_factors is not None:
        long, short = (np.asarray(f, np.float64).reshape(-1) for f in rope_factors)
        if long.shape != (rot_dim // 2,) or short.shape != (rot_dim // 2,):
            raise CheckpointError(f"{path}: {ROPE_FACTORS_LONG} / {ROPE_FACTORS_SHORT} have "
                                  f"{long.size} / {short.size} entries, expected "
                                  f"{rot_dim // 2} (half the rotary dimension)")
        factor = context / original
        default_attention = (1.0 if factor <= 1 else
                             math.sqrt(1 + math.log(factor) / math.log(original)))
        return RopeScaling(
            "longrope", factor=factor, original_max_position_embeddings=original,
            attention_factor=m.number("rope.scaling.attn_factor", default_attention),
            short_factor=tuple(float(x) for x in short),
            long_factor=tuple(float(x) for x in long), long_context=context > original,
            **shared)
    if kind == "linear":
        return RopeScaling("linear", factor=m.number("rope.scaling.factor", 1.0), **shared)
    if kind == "yarn":
        factor = m.number("rope.scaling.factor", 1.0)
        mscale = 1.0 if factor <= 1 else 0.1 * math.log(factor) + 1.0
        return RopeScaling(
            "yarn", factor=factor, original_max_position_embeddings=original,
            beta_fast=m.number("rope.scaling.yarn_beta_fast", 32.0),
            beta_slow=m.number("rope.scaling.yarn_beta_slow", 1.0),
            attention_factor=m.number("rope.scaling.attn_factor", 1.0) * mscale, **shared)
    if kind not in ("none", ""):
        raise UnsupportedModelError(f"{path}: RoPE scaling type {kind!r} is not supported "
                                    "(supported: none, linear, yarn; llama3 and longrope as "
                                    "their factor tensors)")
    return RopeScaling("default", **shared) if partial != 1.0 else None


def config_from_metadata(meta: Mapping[str, Any], shapes: Mapping[str, Sequence[int]],
                         path: Path, rope_freqs: np.ndarray | None = None,
                         rope_factors: tuple[np.ndarray, np.ndarray] | None = None
                         ) -> ModelConfig:
    """Builds the `ModelConfig` of a GGUF file.

    `meta` is the file's metadata as plain values, `shapes` maps each GGUF tensor name to its
    numpy shape (HF order, `[out, in]`), `rope_freqs` is the dequantized `rope_freqs.weight`
    when the file has one, `rope_factors` Phi-3's `(rope_factors_long, rope_factors_short)`
    (each `[R / 2]`) when it has them. Raises `UnsupportedModelError` for architectures or features
    Metrale-JAX does not implement, `CheckpointError` for missing or malformed metadata.
    """
    arch = meta.get("general.architecture")
    family = family_of_gguf(arch)
    if family is None:
        raise UnsupportedModelError(
            f"{path}: GGUF architecture {arch!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
    m = GgufMetadata(meta, arch, path)

    E = m.integer("embedding_length")
    L = m.integer("block_count")
    F = m.integer("feed_forward_length")
    H = m.integer("attention.head_count")
    K = m.integer("attention.head_count_kv", default=H)
    if H <= 0 or K <= 0:
        raise CheckpointError(f"{path}: GGUF metadata has head_count={H}, head_count_kv={K}")
    fallback_D = (m.integer("rope.dimension_count", E // H) if family.gguf_head_dim_from_rope
                  else E // H)
    D = m.integer("attention.key_length", fallback_D)
    value_D = m.integer("attention.value_length", D)
    if value_D != D:
        raise UnsupportedModelError(f"{path}: key_length {D} != value_length {value_D}")
    rot_dim = m.integer("rope.dimension_count", D)
    if rot_dim != D and (family.gguf_permuted_qk or not 0 < rot_dim < D or rot_dim % 2):
        raise UnsupportedModelError(
            f"{path}: partial rotary embeddings (rope.dimension_count={rot_dim}, head "
            f"dimension {D}) are not supported for {arch!r}")

    tokens = meta.get("tokenizer.ggml.tokens")
    if m.has("vocab_size"):
        V = m.integer("vocab_size")
    elif isinstance(tokens, list) and tokens:
        V = len(tokens)
    elif "token_embd.weight" in shapes:
        V = int(shapes["token_embd.weight"][0])
    else:
        raise CheckpointError(f"{path}: cannot tell the vocabulary size (no vocab_size, "
                              "no token list, no token_embd.weight)")

    theta = m.number("rope.freq_base", 10000.0)
    scaling = gguf_rope_scaling(m, rot_dim / D, rope_freqs, rope_factors, theta, rot_dim)

    bos = meta.get("tokenizer.ggml.bos_token_id")
    fields: dict[str, Any] = dict(
        architecture=family.name,
        vocab_size=V,
        hidden_size=E,
        intermediate_size=F,
        num_layers=L,
        num_heads=H,
        num_kv_heads=K,
        head_dim=D,
        rms_norm_eps=m.number("attention.layer_norm_rms_epsilon", 1e-5),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=m.integer("context_length", 2048),
        tie_word_embeddings="output.weight" not in shapes,
        hidden_act="silu",
        attention_bias="blk.0.attn_q.bias" in shapes,
        bos_token_id=bos if isinstance(bos, int) and bos >= 0 else None,
        eos_token_ids=_eos_ids(meta),
    )
    config = ModelConfig(**{**fields, **family.graph, **family.gguf_switches(m, fields)})
    experts = [n for n in shapes if "_exps" in n]
    if experts and not config.is_moe:
        raise UnsupportedModelError(
            f"{path}: mixture-of-experts tensors (e.g. {experts[0]}) in a {arch} file without "
            f"{m.key('expert_count')}: Metrale-JAX reads mixture-of-experts models as qwen3moe "
            "and as llama with experts (Mixtral)")
    return config
