"""Gemma 2: Gemma's graph with four norms per layer, soft-capped attention and final logits,
a query scale of `query_pre_attn_scalar^-1/2`, and sliding-window attention on alternate
layers (even layers local, as transformers' default `layer_types`).

GGUF: llama.cpp's defaults where a key is absent (window 4096, caps 50 / 30); its
`ffn_norm` is HF's `pre_feedforward_layernorm` and its `post_attention_norm` HF's
`post_attention_layernorm`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from metrale_jax.families import gemma
from metrale_jax.families.family import Family, GgufMetadata, layer_windows


def hf_switches(cfg: Mapping[str, Any], num_layers: int) -> dict[str, Any]:
    """Windows (alternating unless `layer_types` says otherwise), soft-caps, query scale."""
    layer_types = cfg.get("layer_types") or [
        "sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(num_layers)]
    scalar = cfg.get("query_pre_attn_scalar")
    return {**layer_windows(cfg.get("sliding_window"), layer_types),
            "attn_logit_softcap": cfg.get("attn_logit_softcapping"),
            "final_logit_softcap": cfg.get("final_logit_softcapping"),
            "query_pre_attn_scalar": float(scalar) if scalar else None}


def gguf_switches(meta: GgufMetadata, fields: Mapping[str, Any]) -> dict[str, Any]:
    """Gemma's, plus the window, the even layers local, the soft-caps and the query scale."""
    L, E, H = fields["num_layers"], fields["hidden_size"], fields["num_heads"]
    return {
        **gemma.gguf_switches(meta, fields),
        "sliding_window": meta.integer("attention.sliding_window", 4096),
        "sliding_layers": tuple(i % 2 == 0 for i in range(L)),
        "attn_logit_softcap": meta.number("attn_logit_softcapping", 50.0),
        "final_logit_softcap": meta.number("final_logit_softcapping", 30.0),
        # llama.cpp scales queries by head_dim^-1/2, except for the 46-layer 27B model whose
        # query_pre_attn_scalar is hidden_size / num_heads (as HF's config says).
        "query_pre_attn_scalar": float(E // H) if L == 46 else float(fields["head_dim"]),
    }


FAMILY = Family(
    name="gemma2",
    summary="Gemma 2: Gemma with post-norms, soft-caps and alternating sliding windows",
    hf_model_types=("gemma2",),
    gguf_architectures=("gemma2",),
    cache=("full", "sliding"),
    graph={**gemma.GRAPH, "post_norms": True},
    hf_defaults={"tie_word_embeddings": True},
    hf_switches=hf_switches,
    gguf_switches=gguf_switches,
    chat_template=gemma.CHAT_TEMPLATE,
    gguf_layer_tensors={
        "ffn_norm.weight": "pre_feedforward_layernorm.weight",
        "post_attention_norm.weight": "post_attention_layernorm.weight",
        "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    },
)
