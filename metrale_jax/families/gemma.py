"""Gemma: RMSNorm scaling by `1 + weight`, embeddings times sqrt(E), GeGLU (tanh GELU), tied
embeddings by default.

GGUF: llama.cpp stores the norms as `1 + weight` already (the reader subtracts 1), writes no
activation (GELU tanh) and defaults the norm epsilon to 1e-6.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from metrale_jax.families.family import Family, GgufMetadata, hf_layer_windows

GRAPH: Mapping[str, Any] = {"norm_weight_offset": True, "embed_scale": True}


def gguf_switches(meta: GgufMetadata, fields: Mapping[str, Any]) -> dict[str, Any]:
    """The GELU tanh activation and the 1e-6 norm epsilon default."""
    return {"hidden_act": "gelu_tanh",
            "rms_norm_eps": meta.number("attention.layer_norm_rms_epsilon", 1e-6)}


FAMILY = Family(
    name="gemma",
    summary="Gemma: offset norms, scaled embeddings, GeGLU",
    hf_model_types=("gemma",),
    gguf_architectures=("gemma",),
    cache=("full", "sliding"),
    graph=GRAPH,
    hf_defaults={"tie_word_embeddings": True},
    hf_switches=hf_layer_windows,
    gguf_switches=gguf_switches,
)
