"""Reads the tensors of a Hugging Face folder: `model.safetensors` or a sharded set listed in
`model.safetensors.index.json`. Returns the canonical tensors (HF names and shapes, numpy)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors import SafetensorError, safe_open

from metrale_jax.errors import CheckpointError


def safetensors_files(folder: Path) -> list[Path]:
    """The safetensors files of a HF folder, checking that every shard the index names exists."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index}: not a valid safetensors index ({e})") from None
        files = sorted({folder / name for name in weight_map.values()})
        for f in files:
            if not f.is_file():
                raise CheckpointError(f"{f}: shard listed in {index.name} is missing")
        return files
    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
    raise CheckpointError(f"{folder}: no model.safetensors or model.safetensors.index.json")


def read_safetensors(folder: Path) -> dict[str, np.ndarray]:
    """Every tensor of the folder by its HF name, as numpy (bfloat16 stays ml_dtypes.bfloat16)."""
    tensors: dict[str, np.ndarray] = {}
    for path in safetensors_files(folder):
        try:
            with safe_open(str(path), framework="flax") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    tensors[name] = np.asarray(f.get_tensor(name))
        except (SafetensorError, OSError, ValueError) as e:
            raise CheckpointError(f"{path}: cannot read safetensors file ({e})") from None
    return tensors


def with_model_prefix(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A decoder's tensors under the names of its `*ForCausalLM` (`model.embed_tokens...`):
    a folder saved from the bare `*Model` (Qwen3-Embedding's: `embed_tokens.weight`,
    `layers.{i}...`, `norm.weight`, no `lm_head`) has its names prefixed with "model.";
    any other set of tensors is returned as it is."""
    if "embed_tokens.weight" not in tensors or any(k.startswith("model.") for k in tensors):
        return tensors
    return {k if k.startswith("lm_head.") else f"model.{k}": v for k, v in tensors.items()}
