"""Llama 2 / 3.x and SmolLM2: the base decoder (pre-norm, RoPE, SwiGLU, grouped-query
attention) that every other decoder family varies with a few switches.

GGUF: llama.cpp's "llama" architecture also carries Mistral-style models (with a sliding
window key); its converter permuted the Q and K rows and may give the head dim only as
`rope.dimension_count`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from metrale_jax.families.family import (
    Family,
    GgufMetadata,
    gguf_expert_fields,
    hf_layer_windows,
)


def gguf_switches(meta: GgufMetadata, fields: Mapping[str, Any]) -> dict[str, Any]:
    """A window on every layer when the file sets `llama.attention.sliding_window`; a file
    with `llama.expert_count` > 0 is a Mixtral (llama.cpp's converter writes it as llama)."""
    out: dict[str, Any] = {}
    if meta.has("attention.sliding_window"):
        out["sliding_window"] = meta.integer("attention.sliding_window") or None
    if meta.integer("expert_count", 0) > 0:
        out.update(architecture="mixtral",
                   **gguf_expert_fields(meta, fields, norm_default=True))
    return out


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
