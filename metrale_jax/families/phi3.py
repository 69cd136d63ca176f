"""Phi-3 / Phi-3.5 / Phi-4: Llama's graph with fused projections, LongRoPE and partial rotary.

transformers' `phi3` (Phi-3-mini / small-free / medium, Phi-3.5-mini, Phi-4 and Phi-4-mini all
use it): q/k/v are one `qkv_proj` and gate/up one `gate_up_proj` (split at load:
`weights/assemble.unfuse_projections`); a sliding window on every layer when
`sliding_window` is set (Phi-3-mini-4k: 2047); LongRoPE `rope_scaling` with short and long
factors (its configs' "su" and "yarn" types mean LongRoPE, as `Phi3Config` maps them);
Phi-4-mini rotates only `partial_rotary_factor` (0.75) of each head's dimensions.

GGUF (llama.cpp's `phi3`): `attn_qkv` and `ffn_up` hold the fused projections as HF does (gate
first, then up); the LongRoPE factors are the `rope_factors_long` / `rope_factors_short`
tensors with `rope.scaling.attn_factor` and `rope.scaling.original_context_length`
(`weights/gguf_names.py`); `rope.dimension_count` below the head dim is partial rotary.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from metrale_jax.families import mistral
from metrale_jax.families.family import Family, GgufMetadata


def gguf_switches(meta: GgufMetadata, fields: Mapping[str, Any]) -> dict[str, Any]:
    """A window on every layer when `phi3.attention.sliding_window` is set and not 0."""
    return {"sliding_window": meta.integer("attention.sliding_window", 0) or None}


FAMILY = Family(
    name="phi3",
    summary="Phi-3 / Phi-3.5 / Phi-4: Llama with fused qkv and gate_up, LongRoPE",
    hf_model_types=("phi3",),
    gguf_architectures=("phi3",),
    cache=("full", "sliding"),
    hf_switches=mistral.hf_switches,  # sliding_window on every layer, as Mistral
    gguf_switches=gguf_switches,
    gguf_layer_tensors={"attn_qkv.weight": "self_attn.qkv_proj.weight",
                        "ffn_up.weight": "mlp.gate_up_proj.weight"},
    hf_rope_aliases={"su": "longrope", "yarn": "longrope"},
    fused_projections=True,
)
