"""Qwen2 / Qwen2.5: Llama's graph with biases on the q/k/v projections (on unless the
config says `attention_bias: false`); sliding layers only with `use_sliding_window`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from metrale_jax.families.family import Family, layer_windows


def hf_switches(cfg: Mapping[str, Any], num_layers: int) -> dict[str, Any]:
    """Qwen's configs carry `sliding_window` and `layer_types` even when unused: they count
    only with `use_sliding_window: true`."""
    if not cfg.get("use_sliding_window", False):
        return layer_windows(None, None)
    return layer_windows(cfg.get("sliding_window"), cfg.get("layer_types"))


FAMILY = Family(
    name="qwen2",
    summary="Qwen2 / Qwen2.5: Llama with q/k/v biases",
    hf_model_types=("qwen2",),
    gguf_architectures=("qwen2",),
    cache=("full", "sliding"),
    hf_defaults={"attention_bias": True},
    hf_switches=hf_switches,
)
