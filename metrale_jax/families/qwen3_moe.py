"""Qwen3-MoE: Qwen3's attention (q/k norms) with every layer's MLP a routed mixture of
experts: softmax over the router's X logits, the top k kept, renormalized when
`norm_topk_prob` (`models/moe.py`). No shared expert.

Checkpoints whose `mlp_only_layers` or `decoder_sparse_step` leave some layers dense are
refused (the released Qwen3-MoE models route every layer). GGUF: llama.cpp's `qwen3moe`
(`{arch}.expert_count`, `expert_used_count`, `expert_feed_forward_length`), which always
renormalizes the top-k weights.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from metrale_jax.errors import UnsupportedModelError
from metrale_jax.families import qwen2
from metrale_jax.families.family import (
    GGUF_EXPERT_TENSORS,
    Family,
    GgufMetadata,
    gguf_expert_fields,
)


def hf_switches(cfg: Mapping[str, Any], num_layers: int) -> dict[str, Any]:
    """Qwen2's windows, plus the experts (`num_experts`, saved as `num_local_experts` by
    transformers 5)."""
    step = int(cfg.get("decoder_sparse_step") or 1)
    if cfg.get("mlp_only_layers") or step != 1:
        raise UnsupportedModelError(
            "qwen3_moe models with dense layers (mlp_only_layers / decoder_sparse_step > 1) "
            "are not supported: every layer must be a mixture of experts")
    experts = cfg.get("num_experts", cfg.get("num_local_experts"))
    return {**qwen2.hf_switches(cfg, num_layers),
            "num_experts": int(experts if experts is not None else 128),
            "experts_per_token": int(cfg.get("num_experts_per_tok", 8)),
            "moe_intermediate_size": int(cfg.get("moe_intermediate_size", 768)),
            "norm_topk_prob": bool(cfg.get("norm_topk_prob", False))}


def gguf_switches(meta: GgufMetadata, fields: Mapping[str, Any]) -> dict[str, Any]:
    """The experts, the top-k weights renormalized (llama.cpp's qwen3moe graph)."""
    return gguf_expert_fields(meta, fields, norm_default=True)


FAMILY = Family(
    name="qwen3_moe",
    summary="Qwen3-MoE: Qwen3 with routed experts in every layer",
    hf_model_types=("qwen3_moe",),
    gguf_architectures=("qwen3moe",),
    cache=("full", "sliding"),
    graph={"qk_norm": True},
    hf_switches=hf_switches,
    gguf_switches=gguf_switches,
    gguf_layer_tensors=GGUF_EXPERT_TENSORS,
)
