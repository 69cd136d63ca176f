"""The one table of model families, and the look-ups the readers use.

`REGISTRY` maps each family's name to its `Family`; a new family is one module beside this
one and one line here. The indexes by HF `model_type` and GGUF `general.architecture`, and
`ARCHITECTURES` (the values `ModelConfig.architecture` may take), derive from it.
"""

from __future__ import annotations

from metrale_jax.families import (
    gemma,
    gemma2,
    gemma3,
    llama,
    llava,
    m2m100,
    mistral,
    mixtral,
    phi3,
    qwen2,
    qwen3,
    qwen3_moe,
)
from metrale_jax.families.family import Family

REGISTRY: dict[str, Family] = {family.name: family for family in (
    llama.FAMILY,
    mistral.FAMILY,
    qwen2.FAMILY,
    qwen3.FAMILY,
    gemma.FAMILY,
    gemma2.FAMILY,
    gemma3.FAMILY,
    phi3.FAMILY,
    qwen3_moe.FAMILY,
    mixtral.FAMILY,
    m2m100.FAMILY,
    llava.FAMILY,
)}


def _index(keys: str) -> dict[str, Family]:
    """Each family's `keys` (a tuple field of `Family`) -> the family; a name claimed twice
    is a mistake in the table."""
    index: dict[str, Family] = {}
    for family in REGISTRY.values():
        for key in getattr(family, keys):
            if key in index:
                raise ValueError(f"{keys} {key!r} is claimed by both {index[key].name!r} and "
                                 f"{family.name!r}")
            index[key] = family
    return index


BY_HF_MODEL_TYPE: dict[str, Family] = _index("hf_model_types")
"""`config.json` `model_type` -> its family."""
BY_GGUF_ARCHITECTURE: dict[str, Family] = _index("gguf_architectures")
"""GGUF `general.architecture` -> its family."""

ARCHITECTURES: tuple[str, ...] = tuple(
    name for name, family in REGISTRY.items() if family.kind != "vision_language")
"""What `ModelConfig.architecture` may be: every family but the vision-language ones (whose
configs carry their text model's architecture)."""


def family_of_hf(model_type: object) -> Family | None:
    """The family of a `config.json` `model_type`, or None when no family reads it."""
    return BY_HF_MODEL_TYPE.get(model_type) if isinstance(model_type, str) else None


def family_of_gguf(architecture: object) -> Family | None:
    """The family of a GGUF `general.architecture`, or None when no family reads it."""
    return BY_GGUF_ARCHITECTURE.get(architecture) if isinstance(architecture, str) else None


def family_of_config(architecture: str) -> Family:
    """The family of a `ModelConfig.architecture` (always registered: `ModelConfig` checks)."""
    return REGISTRY[architecture]


__all__ = ["ARCHITECTURES", "BY_GGUF_ARCHITECTURE", "BY_HF_MODEL_TYPE", "REGISTRY",
           "family_of_config", "family_of_gguf", "family_of_hf"]
