"""Reads a Hugging Face `config.json` into a `ModelConfig`.

Covers transformers 4.x field names (`rope_theta`, `rope_scaling`) and 5.x ones
(`rope_parameters`). The fields every decoder family shares are read here; the family (found
by `model_type` in `metrale_jax.families`) adds its layer graph and its own switches.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from metrale_jax.config import ROPE_KINDS, ModelConfig, RopeScaling
from metrale_jax.errors import CheckpointError, UnsupportedModelError
from metrale_jax.families import Family, family_of_hf, llava
from metrale_jax.families.registry import BY_HF_MODEL_TYPE

log = logging.getLogger(__name__)

DECODER_MODEL_TYPES: tuple[str, ...] = tuple(sorted(
    model_type for model_type, family in BY_HF_MODEL_TYPE.items() if family.kind == "decoder"))
"""The `model_type`s `model_config_from_hf` reads: the decoder-only families'."""


def rope_from_hf(params: Mapping[str, Any], cfg: Mapping[str, Any], family: Family,
                 path: Path) -> tuple[float, RopeScaling | None]:
    """`(rope_theta, scaling)` of one flat RoPE parameter dict (transformers 5's
    `rope_parameters`, or 4.x's `rope_scaling` merged with the top-level `rope_theta`) of
    config.json `cfg`, with transformers' defaults (`modeling_rope_utils`): factors left out
    derived from `max_position_embeddings / original_max_position_embeddings`, the yarn and
    longrope attention factors computed. None when nothing is scaled. Raises
    `UnsupportedModelError` naming a `rope_type` Metrale-JAX does not implement."""
    theta = float(params.get("rope_theta") or cfg.get("rope_theta") or 10000.0)
    kind = params.get("rope_type", params.get("type")) or "default"
    kind = family.hf_rope_aliases.get(kind, kind)
    partial = float(params.get("partial_rotary_factor") or cfg.get("partial_rotary_factor")
                    or 1.0)
    max_pos = int(cfg.get("max_position_embeddings", 2048))
    # transformers lets a top-level original_max_position_embeddings (Phi-3) win.
    original = int(cfg.get("original_max_position_embeddings")
                   or params.get("original_max_position_embeddings") or max_pos)
    shared: dict[str, Any] = {"partial_rotary_factor": partial}
    if kind == "default":
        return theta, RopeScaling("default", **shared) if partial != 1.0 else None
    if kind in ("linear", "dynamic"):
        return theta, RopeScaling(kind, factor=float(params["factor"]), **shared)
    if kind == "llama3":
        return theta, RopeScaling(
            "llama3", factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position_embeddings=original, **shared)
    factor = float(params.get("factor") or max_pos / original)
    attention = params.get("attention_factor")
    if kind == "yarn":
        if attention is None:
            mscale, mscale_all = params.get("mscale"), params.get("mscale_all_dim")
            attention = (yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all)
                         if mscale and mscale_all else yarn_mscale(factor))
        return theta, RopeScaling(
            "yarn", factor=factor, original_max_position_embeddings=original,
            beta_fast=float(params.get("beta_fast") or 32),
            beta_slow=float(params.get("beta_slow") or 1),
            truncate=bool(params.get("truncate", True)), attention_factor=float(attention),
            **shared)
    if kind == "longrope":
        return theta, RopeScaling(
            "longrope", factor=factor, original_max_position_embeddings=original,
            attention_factor=float(attention if attention is not None
                                   else longrope_attention_factor(factor, original)),
            short_factor=tuple(float(x) for x in params["short_factor"]),
            long_factor=tuple(float(x) for x in params["long_factor"]),
            long_context=max_pos > original, **shared)
    raise UnsupportedModelError(f"{path}: RoPE scaling type {kind!r} is not supported "
                                f"(supported: {', '.join(ROPE_KINDS)})")


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention scale `0.1 * mscale * ln(factor) + 1` (1 for factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def longrope_attention_factor(factor: float, original: int) -> float:
    """LongRoPE's attention scale `sqrt(1 + ln(factor) / ln(original))` (1 for factor <= 1)."""
    return 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))


def _rope(cfg: dict[str, Any], family: Family, path: Path) -> tuple[float, RopeScaling | None]:
    params = dict(cfg.get("rope_parameters") or {})
    if isinstance(params.get("full_attention"), dict):
        # transformers 5's per-layer-type parameters (Gemma 3): the global layers' are the
        # model's; the family reads the sliding layers' base
        params = dict(params["full_attention"])
    params = {**(cfg.get("rope_scaling") or {}), **params}
    return rope_from_hf(params, cfg, family, path)


def _ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(int(v) for v in value) if isinstance(value, list) else (int(value),)


def decoder_family(model_type: Any, path: Path) -> Family:
    """The decoder-only family of `model_type`; `UnsupportedModelError` for any other."""
    family = family_of_hf(model_type)
    if family is None or family.kind != "decoder":
        raise UnsupportedModelError(
            f"{path}: model_type {model_type!r} is not supported "
            f"(supported: {', '.join(DECODER_MODEL_TYPES)})")
    return family


def model_config_from_hf(cfg: dict[str, Any], path: Path) -> ModelConfig:
    """Builds a decoder-only `ModelConfig` from the parsed `config.json` dict; `path` names it
    in errors. The shared fields, then the family's `graph`, then its `hf_switches`."""
    family = decoder_family(cfg.get("model_type"), path)

    def field(key: str, default: Any) -> Any:
        return cfg.get(key, family.hf_defaults.get(key, default))

    try:
        E = int(cfg["hidden_size"])
        H = int(cfg["num_attention_heads"])
        theta, scaling = _rope(cfg, family, path)
        K = int(cfg.get("num_key_value_heads") or H)
        D = int(cfg.get("head_dim") or E // H)
        layers = int(cfg["num_hidden_layers"])
        act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu"
        switches = family.hf_switches(cfg, layers)
        fields: dict[str, Any] = dict(
            architecture=family.name,
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
            tie_word_embeddings=bool(field("tie_word_embeddings", False)),
            hidden_act="gelu_tanh" if act.startswith("gelu") else "silu",
            attention_bias=bool(field("attention_bias", False)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=_ids(cfg.get("eos_token_id")),
        )
        return ModelConfig(**{**fields, **family.graph, **switches})
    except KeyError as e:
        raise CheckpointError(f"{path}: config is missing the field {e.args[0]!r}") from None
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{path}: config has a bad value: {e}") from None


def llava_model_config(config: dict[str, Any], path: Path) -> ModelConfig:
    """The `ModelConfig` of a LLaVA `config.json`: its text model's (read by the text model's
    own family), with `vision` set (`families.llava`)."""
    base = model_config_from_hf(llava.text_config(config, path), path)
    vision = llava.vision_config(config, base.hidden_size, base.vocab_size, path)
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
    if family_of_hf(cfg.get("model_type")) is llava.FAMILY:  # its text model, with `vision`
        config = llava_model_config(cfg, path)
    else:
        config = model_config_from_hf(cfg, path)
    gen = read_generation_config(folder)
    if gen.get("eos_token_id") is not None:
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
