"""What llama.cpp's GGUF names mean: metadata keys -> `ModelConfig`, tensor names -> HF names.

`gguf_reader` opens the file and dequantizes; this module holds the facts about llama.cpp's
conversion (`convert_hf_to_gguf.py`) that turn a GGUF back into canonical tensors:

- tensor names: `blk.{i}.attn_q.weight` is `model.layers.{i}.self_attn.q_proj.weight`, and so on
  (`TENSOR_NAMES` in `gguf.constants`). Gemma 2's `ffn_norm` is HF's
  `pre_feedforward_layernorm`, and its `post_attention_norm` is HF's `post_attention_layernorm`.
- config: `{arch}.block_count`, `{arch}.attention.head_count`, ... with llama.cpp's defaults
  where a key is optional (rope base 10000, Gemma 2 soft-caps 50/30 and window 4096).
- Llama 3 RoPE: llama.cpp stores the per-frequency divisors as the `rope_freqs.weight` tensor
  instead of metadata; `llama3_rope_scaling` recovers transformers' four parameters from it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from metrale_jax.config import ModelConfig, RopeScaling
from metrale_jax.errors import CheckpointError, UnsupportedModelError

SUPPORTED_ARCHITECTURES: tuple[str, ...] = ("llama", "qwen2", "qwen3", "gemma", "gemma2")

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

# Gemma 2 has four norms per layer; llama.cpp's `ffn_norm` is the one before the MLP.
GEMMA2_LAYER_TENSORS: dict[str, str] = {
    **LAYER_TENSORS,
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}

# Tensors llama.cpp may write that have no HF parameter (handled or ignored by the reader).
ROPE_FREQS = "rope_freqs.weight"
IGNORED_LAYER_SUFFIXES: tuple[str, ...] = ("attn_rot_embd.weight",)  # old rotary inv_freq


def layer_table(arch: str) -> dict[str, str]:
    """The per-layer GGUF-suffix -> HF-suffix table for `arch`."""
    return GEMMA2_LAYER_TENSORS if arch == "gemma2" else LAYER_TENSORS


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
    projections, `[E]` or `[D]` for norms); `optional` names the ones a file may omit
    (`lm_head.weight` when embeddings are tied).
    """
    V, E, F = cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size
    H, K, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (V, E),
        "model.norm.weight": (E,),
        "lm_head.weight": (V, E),
    }
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (E,),
            p + "post_attention_layernorm.weight": (E,),
            p + "self_attn.q_proj.weight": (H * D, E),
            p + "self_attn.k_proj.weight": (K * D, E),
            p + "self_attn.v_proj.weight": (K * D, E),
            p + "self_attn.o_proj.weight": (E, H * D),
            p + "mlp.gate_proj.weight": (F, E),
            p + "mlp.up_proj.weight": (F, E),
            p + "mlp.down_proj.weight": (E, F),
        })
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


def _get(meta: Mapping[str, Any], key: str, path: Path, default: Any = None,
         required: bool = False) -> Any:
    if key not in meta:
        if required:
            raise CheckpointError(f"{path}: GGUF metadata has no {key!r}")
        return default
    value = meta[key]
    if isinstance(value, list):
        raise UnsupportedModelError(
            f"{path}: per-layer values for {key!r} are not supported (got a list)")
    return value


def _int(meta: Mapping[str, Any], key: str, path: Path, default: int | None = None) -> int:
    value = _get(meta, key, path, default, required=default is None)
    try:
        return int(value)
    except (TypeError, ValueError):
        raise CheckpointError(f"{path}: GGUF metadata {key!r} is not an integer: "
                              f"{value!r}") from None


def _float(meta: Mapping[str, Any], key: str, path: Path, default: float) -> float:
    value = _get(meta, key, path, default)
    try:
        return float(value)
    except (TypeError, ValueError):
        raise CheckpointError(f"{path}: GGUF metadata {key!r} is not a number: "
                              f"{value!r}") from None


def _eos_ids(meta: Mapping[str, Any]) -> tuple[int, ...]:
    """eos, then end-of-turn and end-of-message ids: llama.cpp stops on all of them."""
    ids: list[int] = []
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                "tokenizer.ggml.eom_token_id"):
        value = meta.get(key)
        if isinstance(value, int) and value >= 0 and value not in ids:
            ids.append(value)
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


def config_from_metadata(meta: Mapping[str, Any], shapes: Mapping[str, Sequence[int]],
                         path: Path, rope_freqs: np.ndarray | None = None) -> ModelConfig:
    """Builds the `ModelConfig` of a GGUF file.

    `meta` is the file's metadata as plain values, `shapes` maps each GGUF tensor name to its
    numpy shape (HF order, `[out, in]`), `rope_freqs` is the dequantized `rope_freqs.weight`
    when the file has one. Raises `UnsupportedModelError` for architectures or features
    Metrale-JAX does not implement, `CheckpointError` for missing or malformed metadata.
    """
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"{path}: GGUF architecture {arch!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
    if _int(meta, f"{arch}.expert_count", path, 0) > 0 or any("_exps" in n for n in shapes):
        raise UnsupportedModelError(f"{path}: mixture-of-experts models are not supported")

    E = _int(meta, f"{arch}.embedding_length", path)
    L = _int(meta, f"{arch}.block_count", path)
    F = _int(meta, f"{arch}.feed_forward_length", path)
    H = _int(meta, f"{arch}.attention.head_count", path)
    K = _int(meta, f"{arch}.attention.head_count_kv", path, default=H)
    if H <= 0 or K <= 0:
        raise CheckpointError(f"{path}: GGUF metadata has head_count={H}, head_count_kv={K}")
    rope_dim_key = f"{arch}.rope.dimension_count"
    fallback_D = _int(meta, rope_dim_key, path, E // H) if arch == "llama" else E // H
    D = _int(meta, f"{arch}.attention.key_length", path, fallback_D)
    value_D = _int(meta, f"{arch}.attention.value_length", path, D)
    if value_D != D:
        raise UnsupportedModelError(f"{path}: key_length {D} != value_length {value_D}")
    rot_dim = _int(meta, rope_dim_key, path, D)
    if rot_dim != D:
        raise UnsupportedModelError(
            f"{path}: partial rotary embeddings (rope.dimension_count={rot_dim}, head "
            f"dimension {D}) are not supported")

    tokens = meta.get("tokenizer.ggml.tokens")
    if f"{arch}.vocab_size" in meta:
        V = _int(meta, f"{arch}.vocab_size", path)
    elif isinstance(tokens, list) and tokens:
        V = len(tokens)
    elif "token_embd.weight" in shapes:
        V = int(shapes["token_embd.weight"][0])
    else:
        raise CheckpointError(f"{path}: cannot tell the vocabulary size (no vocab_size, "
                              "no token list, no token_embd.weight)")

    theta = _float(meta, f"{arch}.rope.freq_base", path, 10000.0)
    scaling: RopeScaling | None = None
    kind = str(_get(meta, f"{arch}.rope.scaling.type", path, "none")).lower()
    if rope_freqs is not None:
        scaling = llama3_rope_scaling(rope_freqs, theta, rot_dim, path)
    elif kind == "linear":
        scaling = RopeScaling("linear", factor=_float(meta, f"{arch}.rope.scaling.factor",
                                                      path, 1.0))
    elif kind not in ("none", ""):
        raise UnsupportedModelError(f"{path}: RoPE scaling type {kind!r} is not supported "
                                    "(supported: none, linear, llama3)")

    gemma = arch in ("gemma", "gemma2")
    window: int | None = None
    sliding: tuple[bool, ...] = ()
    attn_cap = final_cap = qpas = None
    if arch == "gemma2":
        window = _int(meta, f"{arch}.attention.sliding_window", path, 4096)
        sliding = tuple(i % 2 == 0 for i in range(L))  # HF Gemma 2: even layers are local
        attn_cap = _float(meta, f"{arch}.attn_logit_softcapping", path, 50.0)
        final_cap = _float(meta, f"{arch}.final_logit_softcapping", path, 30.0)
        # llama.cpp scales queries by head_dim^-1/2, except for the 46-layer 27B model whose
        # query_pre_attn_scalar is hidden_size / num_heads (as HF's config says).
        qpas = float(E // H) if L == 46 else float(D)
    elif arch == "llama" and f"{arch}.attention.sliding_window" in meta:
        window = _int(meta, f"{arch}.attention.sliding_window", path) or None

    bos = meta.get("tokenizer.ggml.bos_token_id")
    return ModelConfig(
        architecture=arch,
        vocab_size=V,
        hidden_size=E,
        intermediate_size=F,
        num_layers=L,
        num_heads=H,
        num_kv_heads=K,
        head_dim=D,
        rms_norm_eps=_float(meta, f"{arch}.attention.layer_norm_rms_epsilon", path,
                            1e-6 if gemma else 1e-5),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=_int(meta, f"{arch}.context_length", path, 2048),
        tie_word_embeddings="output.weight" not in shapes,
        hidden_act="gelu_tanh" if gemma else "silu",
        attention_bias="blk.0.attn_q.bias" in shapes,
        qk_norm=arch == "qwen3",
        norm_weight_offset=gemma,
        embed_scale=gemma,
        post_norms=arch == "gemma2",
        attn_logit_softcap=attn_cap,
        final_logit_softcap=final_cap,
        sliding_window=window,
        sliding_layers=sliding,
        query_pre_attn_scalar=qpas,
        bos_token_id=bos if isinstance(bos, int) and bos >= 0 else None,
        eos_token_ids=_eos_ids(meta),
    )
