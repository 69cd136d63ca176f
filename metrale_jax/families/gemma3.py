"""Gemma 3 (text): Gemma 2's four norms per layer and sliding windows, without soft-caps, with
q/k RMS norms and two RoPE bases: the sliding (local) layers rotate by `rope_local_theta`
(10,000) unscaled, the global ones by `rope_theta` (1,000,000) with the config's
`rope_scaling`. Five local layers to one global (`sliding_window_pattern` 6) unless
`layer_types` says otherwise.

GGUF (llama.cpp's `gemma3`): the window from `attention.sliding_window`, the pattern fixed at
6, the local base fixed at 10,000, the query scale `head_dim^-1/2` (the 62-layer 27B model:
`(E / H)^-1/2`, as its `query_pre_attn_scalar` says); the norms as Gemma 2's plus
`attn_q_norm` / `attn_k_norm` (stored, like every Gemma norm, as `1 + w`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from metrale_jax.families import gemma, gemma2
from metrale_jax.families.family import Family, GgufMetadata, layer_windows

SLIDING_PATTERN = 6
"""transformers' and llama.cpp's default: every sixth layer global, the rest local."""
LOCAL_THETA = 10_000.0


def default_layer_types(num_layers: int, pattern: int = SLIDING_PATTERN) -> list[str]:
    """transformers' Gemma 3 layer kinds: layer i is global when (i + 1) % pattern == 0."""
    return ["sliding_attention" if (i + 1) % pattern else "full_attention"
            for i in range(num_layers)]


def hf_switches(cfg: Mapping[str, Any], num_layers: int) -> dict[str, Any]:
    """Windows, query scale and the local RoPE base (transformers 5's per-layer-type
    `rope_parameters`, or 4.x's `rope_local_base_freq`)."""
    layer_types = cfg.get("layer_types") or default_layer_types(
        num_layers, int(cfg.get("sliding_window_pattern") or SLIDING_PATTERN))
    per_type = cfg.get("rope_parameters") or {}
    local = per_type.get("sliding_attention") if isinstance(per_type, Mapping) else None
    local_theta = ((local or {}).get("rope_theta") or cfg.get("rope_local_base_freq")
                   or LOCAL_THETA)
    scalar = cfg.get("query_pre_attn_scalar", 256)
    return {**layer_windows(cfg.get("sliding_window", 4096), layer_types),
            "attn_logit_softcap": cfg.get("attn_logit_softcapping"),
            "final_logit_softcap": cfg.get("final_logit_softcapping"),
            "query_pre_attn_scalar": float(scalar) if scalar else None,
            "rope_local_theta": float(local_theta)}


def gguf_switches(meta: GgufMetadata, fields: Mapping[str, Any]) -> dict[str, Any]:
    """Gemma's, plus the window on five layers of six, the local base and the query scale."""
    L, E, H = fields["num_layers"], fields["hidden_size"], fields["num_heads"]
    return {
        **gemma.gguf_switches(meta, fields),
        **layer_windows(meta.integer("attention.sliding_window", 4096),
                        default_layer_types(L)),
        "query_pre_attn_scalar": float(E // H) if L == 62 else float(fields["head_dim"]),
        "rope_local_theta": LOCAL_THETA,
    }


FAMILY = Family(
    name="gemma3",
    summary="Gemma 3: Gemma 2's norms and windows, q/k norms, a local and a global RoPE base",
    hf_model_types=("gemma3_text",),
    gguf_architectures=("gemma3",),
    cache=("full", "sliding"),
    graph={**gemma.GRAPH, "post_norms": True, "qk_norm": True},
    hf_defaults={"tie_word_embeddings": True},
    hf_switches=hf_switches,
    gguf_switches=gguf_switches,
    chat_template=gemma.CHAT_TEMPLATE,
    gguf_layer_tensors=gemma2.FAMILY.gguf_layer_tensors,  # the same four norms
)
