"""Mixtral: Mistral's graph (a sliding window on every layer when set) with every layer's
MLP a routed mixture of `num_local_experts` experts of `intermediate_size`: the top k of the
router's logits, softmax over those k (`models/moe.py`, `norm_topk_prob`).

GGUF: llama.cpp writes Mixtral as architecture "llama" with `llama.expert_count` > 0
(`llama.gguf_switches` then names this family), Q and K permuted as Llama's, and the
experts stacked (`blk.N.ffn_{gate,up,down}_exps`, router `ffn_gate_inp`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from metrale_jax.families import mistral
from metrale_jax.families.family import GGUF_EXPERT_TENSORS, Family


def hf_switches(cfg: Mapping[str, Any], num_layers: int) -> dict[str, Any]:
    """Mistral's window, plus the experts (each of the model's `intermediate_size`)."""
    return {**mistral.hf_switches(cfg, num_layers),
            "num_experts": int(cfg.get("num_local_experts", 8)),
            "experts_per_token": int(cfg.get("num_experts_per_tok", 2)),
            "moe_intermediate_size": int(cfg.get("intermediate_size", 14336)),
            "norm_topk_prob": True}


FAMILY = Family(
    name="mixtral",
    summary="Mixtral: Mistral with routed experts in every layer",
    hf_model_types=("mixtral",),
    cache=("full", "sliding"),
    hf_switches=hf_switches,
    gguf_layer_tensors=GGUF_EXPERT_TENSORS,
    gguf_head_dim_from_rope=True,
    gguf_permuted_qk=True,
)
