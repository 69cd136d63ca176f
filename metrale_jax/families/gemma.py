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

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{%- set prefix = messages[0]['content'] | trim + '\n\n' -%}"
    "{%- set turns = messages[1:] -%}"
    "{%- else -%}{%- set prefix = '' -%}{%- set turns = messages -%}{%- endif -%}"
    "{%- for message in turns -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\n' + (prefix if loop.first else '') }}"
    "{{ message['content'] | trim }}{{ '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}")
"""Gemma's turn format (`<start_of_turn>user ... <end_of_turn>`, the system prompt folded into
the first user turn, as Google's templates do) for a Gemma checkpoint that carries no template
(a base model's GGUF)."""


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
    chat_template=CHAT_TEMPLATE,
)
