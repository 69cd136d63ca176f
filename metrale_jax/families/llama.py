"""Llama 2 / 3.x and SmolLM2: the base decoder (pre-norm, RoPE, SwiGLU, grouped-query
attention) that every other decoder family varies with a few switches.

GGUF: llama.cpp's "llama" architecture also carries Mistral-style models (with a sliding
window key); its converter permuted the Q and K rows and may give the head dim only as
`rope.dimension_count`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from metrale_jax.families.family import Family, GgufMetadata, hf_layer_windows


def gguf_switches(meta: GgufMetadata, fields: Mapping[str, Any]) -> dict[str, Any]:
    """A window on every layer when the file sets `llama.attention.sliding_window`."""
    if meta.has("attention.sliding_window"):
        return {"sliding_window": meta.integer("attention.sliding_window") or None}
    return {}


FAMILY = Family(
    name="llama",
    summary="Llama 2 / 3.x, SmolLM2: the base decoder",
    hf_model_types=("llama",),
    gguf_architectures=("llama",),
    cache=("full", "sliding"),
    hf_switches=hf_layer_windows,
    gguf_switches=gguf_switches,
    gguf_head_dim_from_rope=True,
    gguf_permuted_qk=True,
)
