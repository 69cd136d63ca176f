"""A mixture-of-experts layer's tensors in the forms checkpoints hold them -> our layout.

Our params (`models/moe.py`): router `[E, X]`, gate and up `[X, E, F]`, down `[X, F, E]`.
A layer's experts are read from whichever form the tensors have (prefix
`model.layers.{i}.`):

- per expert, as `save_pretrained` writes them (transformers 4 and 5.25 alike):
  Qwen3-MoE `mlp.experts.{j}.gate_proj/up_proj/down_proj.weight`, Mixtral
  `block_sparse_moe.experts.{j}.w1/w3/w2.weight` (`[F, E]`, `[F, E]`, `[E, F]`);
- fused, as transformers 5 holds them in memory (`state_dict()`): `mlp.experts.gate_up_proj`
  `[X, 2F, E]` (gate rows first) and `mlp.experts.down_proj` `[X, E, F]`;
- stacked per projection, as the GGUF reader names llama.cpp's `ffn_*_exps`:
  `mlp.experts.gate_proj.weight` / `up_proj.weight` `[X, F, E]`, `down_proj.weight` `[X, E, F]`.

The router is `mlp.gate.weight` (Mixtral's files: `block_sparse_moe.gate.weight`), `[X, E]`.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np

from metrale_jax.config import ModelConfig
from metrale_jax.errors import CheckpointError

# Our projection -> (Qwen3-MoE per-expert name, Mixtral per-expert name).
PER_EXPERT_NAMES: dict[str, tuple[str, str]] = {
    "gate": ("gate_proj", "w1"), "up": ("up_proj", "w3"), "down": ("down_proj", "w2")}


def router_tensor(tensors: Mapping[str, np.ndarray], layer: int, source: Path | str
                  ) -> tuple[str, np.ndarray]:
    """`(name, router [X, E])` of layer `layer`."""
    p = f"model.layers.{layer}."
    for name in (p + "mlp.gate.weight", p + "block_sparse_moe.gate.weight"):
        if name in tensors:
            return name, np.asarray(tensors[name])
    raise CheckpointError(f"{source}: tensor {p + 'mlp.gate.weight'!r} (the router) is missing")


def expert_tensor(cfg: ModelConfig, tensors: Mapping[str, np.ndarray], layer: int, proj: str,
                  source: Path | str) -> tuple[str, np.ndarray]:
    """`(name, weight)` of projection `proj` ("gate", "up", "down") of layer `layer`'s experts
    in our layout (gate / up `[X, E, F]`, down `[X, F, E]`), from any form the module
    docstring lists; `CheckpointError` naming the tensor when none is there."""
    p = f"model.layers.{layer}."
    X, F = cfg.num_experts, cfg.moe_intermediate_size
    qwen, mixtral = PER_EXPERT_NAMES[proj]
    stacked = f"{p}mlp.experts.{qwen}.weight"
    if stacked in tensors:  # [X, out, in]
        return stacked, np.asarray(tensors[stacked]).transpose(0, 2, 1)
    fused = p + ("mlp.experts.down_proj" if proj == "down" else "mlp.experts.gate_up_proj")
    if fused in tensors:
        w = np.asarray(tensors[fused])
        if proj == "gate":
            w = w[:, :F]
        elif proj == "up":
            w = w[:, F:]
        return fused, w.transpose(0, 2, 1)
    for pattern in (f"{p}mlp.experts.{{j}}.{qwen}.weight",
                    f"{p}block_sparse_moe.experts.{{j}}.{mixtral}.weight"):
        if pattern.format(j=0) in tensors:
            names = [pattern.format(j=j) for j in range(X)]
            missing = [n for n in names if n not in tensors]
            if missing:
                raise CheckpointError(f"{source}: tensor {missing[0]!r} is missing")
            return (pattern.format(j="*"),
                    np.stack([np.asarray(tensors[n]).T for n in names]))
    raise CheckpointError(f"{source}: the experts' {qwen} weights of layer {layer} are missing "
                          f"(looked for {stacked!r}, {fused!r} and per-expert tensors)")


__all__ = ["PER_EXPERT_NAMES", "expert_tensor", "router_tensor"]
