"""Mistral: Llama's graph with a sliding window on every layer when `sliding_window` is set.

GGUF: llama.cpp converts Mistral models as "llama" (see `llama.py`), so this family has no
GGUF architecture of its own.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from metrale_jax.families.family import Family


def hf_switches(cfg: Mapping[str, Any], num_layers: int) -> dict[str, Any]:
    """`sliding_window` applies to every layer (no `layer_types`); null or 0 means none."""
    window = cfg.get("sliding_window")
    return {"sliding_window": int(window) if window else None, "sliding_layers": ()}


FAMILY = Family(
    name="mistral",
    summary="Mistral: Llama with a sliding window on every layer",
    hf_model_types=("mistral",),
    cache=("full", "sliding"),
    hf_switches=hf_switches,
)
