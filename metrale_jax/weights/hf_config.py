"""Reads a Hugging Face `config.json` into a `ModelConfig`.

Covers transformers 4.x field names (`rope_theta`, `rope_scaling`) and 5.x ones
(`rope_parameters`), for the families Metrale-JAX implements.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from metrale_jax.config import ModelConfig, RopeScaling
from metrale_jax.errors import CheckpointError, UnsupportedModelError
from metrale_jax.vision_config import VisionConfig

log = logging.getLogger(__name__)

# transformers `model_type` -> our architecture name.
MODEL_TYPES = {
    "llama": "llama",
    "mistral": "mistral",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma": "gemma",
    "gemma2": "gemma2",
}


def _rope(cfg: dict[str, Any], path: Path) -> tuple[float, RopeScaling | None]:
    params = dict(cfg.get("rope_parameters") or {})
    legacy = cfg.get("rope_scaling") or {}
    params = {**legacy, **params}
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind in (None, "default"):
        return theta, None
    if kind == "linear":
        return theta, RopeScaling("linear", factor=float(params["factor"]))
    if kind == "llama3":
        return theta, RopeScaling(
            "llama3",
            factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position_embeddings=int(params["original_max_position_embeddings"]),
        )
    raise UnsupportedModelError(f"{path}: RoPE scaling type {kind!r} is not supported "
                                "(supported: default, linear, llama3)")


def _ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(int(v) for v in value) if isinstance(value, list) else (int(value),)


def model_config_from_hf(cfg: dict[str, Any], path: Path) -> ModelConfig:
    """Builds a `ModelConfig` from the parsed `config.json` dict; `path` names it in errors."""
    model_type = cfg.get("model_type")
    if model_type not in MODEL_TYPES:
        raise UnsupportedModelError(
            f"{path}: model_type {model_type!r} is not supported "
            f"(supported: {', '.join(sorted(MODEL_TYPES))})")
    arch = MODEL_TYPES[model_type]
    try:
        E = int(cfg["hidden_size"])
        H = int(cfg["num_attention_heads"])
        theta, scaling = _rope(cfg, path)
        K = int(cfg.get("num_key_value_heads") or H)
        D = int(cfg.get("head_dim") or E // H)
        layers = int(cfg["num_hidden_layers"])
        act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu"
        gemma = arch in ("gemma", "gemma2")
        layer_types = cfg.get("layer_types")
        window = cfg.get("sliding_window")
        sliding: tuple[bool, ...] = ()
        if arch == "mistral":
            window = int(window) if window else None
        elif arch == "gemma2":
            layer_types = layer_types or [
                "sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)]
        elif arch in ("qwen2", "qwen3") and not cfg.get("use_sliding_window", False):
            layer_types = None
        if arch != "mistral":
            if layer_types and "sliding_attention" in layer_types and window:
                sliding = tuple(t == "sliding_attention" for t in layer_types)
                window = int(window)
            else:
                window = None
        return ModelConfig(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=E,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=layers,
            num_heads=H,
            num_kv_heads=K,
            head_dim=D,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", gemma)),
            hidden_act="gelu_tanh" if act.startswith("gelu") else "silu",
            attention_bias=bool(cfg.get("attention_bias", arch == "qwen2")),
            qk_norm=arch == "qwen3",
            norm_weight_offset=gemma,
            embed_scale=gemma,
            post_norms=arch == "gemma2",
            attn_logit_softcap=cfg.get("attn_logit_softcapping") if arch == "gemma2" else None,
            final_logit_softcap=cfg.get("final_logit_softcapping") if arch == "gemma2" else None,
            sliding_window=window,
            sliding_layers=sliding,
            query_pre_attn_scalar=(float(cfg["query_pre_attn_scalar"])
                                   if arch == "gemma2" and cfg.get("query_pre_attn_scalar")
                                   else None),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=_ids(cfg.get("eos_token_id")),
        )
    except KeyError as e:
        raise CheckpointError(f"{path}: config is missing the field {e.args[0]!r}") from None
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{path}: config has a bad value: {e}") from None


LLAVA_MODEL_TYPES: tuple[str, ...] = ("llava",)
"""transformers' `model_type`s of the vision-language models we load (`llava_reader`)."""


def is_llava_config(config: Mapping[str, Any]) -> bool:
    """True when a parsed `config.json` is a LLaVA model's."""
    return config.get("model_type") in LLAVA_MODEL_TYPES


def llava_model_config(config: dict[str, Any], path: Path) -> ModelConfig:
    """The `ModelConfig` of a LLaVA `config.json`: its text model's, with `vision` set."""
    text = config.get("text_config")
    if not isinstance(text, dict):
        raise CheckpointError(f"{path}: a LLaVA config needs a text_config")
    text = dict(text)
    text.setdefault("model_type", "llama")
    if "tie_word_embeddings" in config and "tie_word_embeddings" not in text:
        text["tie_word_embeddings"] = config["tie_word_embeddings"]
    base = model_config_from_hf(text, path)
    vision = VisionConfig.from_hf_llava(config, base.hidden_size)
    if not 0 <= vision.image_token_id < base.vocab_size:
        raise CheckpointError(f"{path}: image_token_index {vision.image_token_id} is outside "
                              f"the vocabulary ({base.vocab_size})")
    return dataclasses.replace(base, vision=vision)


def read_hf_config(folder: Path) -> ModelConfig:
    """Reads `folder/config.json` (and eos ids from `generation_config.json` when present)."""
    path = folder / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{folder}: no config.json in this Hugging Face folder")
    try:
        cfg = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None
    if is_llava_config(cfg):  # a vision-language model: its text model, with `vision`
        config = llava_model_config(cfg, path)
    else:
        config = model_config_from_hf(cfg, path)
    gen = read_generation_config(folder)
    if gen.get("eos_token_id") is not None:
        import dataclasses
        config = dataclasses.replace(config, eos_token_ids=_ids(gen["eos_token_id"]))
    return config


def read_generation_config(folder: Path) -> dict[str, Any]:
    """The parsed `generation_config.json`, or `{}` when the folder has none."""
    path = folder / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None
