"""Qwen3: Llama's graph with an RMSNorm over `D` on queries and keys before RoPE (no q/k/v
biases by default); sliding layers as Qwen2 (only with `use_sliding_window`)."""

from __future__ import annotations

from metrale_jax.families import qwen2
from metrale_jax.families.family import Family

FAMILY = Family(
    name="qwen3",
    summary="Qwen3: Llama with q/k norms",
    hf_model_types=("qwen3",),
    gguf_architectures=("qwen3",),
    cache=("full", "sliding"),
    graph={"qk_norm": True},
    hf_switches=qwen2.hf_switches,
)
