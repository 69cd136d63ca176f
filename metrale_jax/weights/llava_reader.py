"""Reads a LLaVA vision-language model from a Hugging Face folder.

The family's facts (its config, the tensor name prefixes) are `families.llava`; the config is
read by `hf_config.llava_model_config`; `preprocessor_config.json` (or transformers 5's
`processor_config.json`) gives the image processor.
The text model's tensors are renamed to the decoder-only names and assembled as any
decoder-only model; the vision tower's and projector's into a `models.vision.VisionEncoder`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from metrale_jax.errors import CheckpointError
from metrale_jax.families.llava import (
    PROJECTOR_PREFIXES,
    TEXT_PREFIXES,
    VISION_PREFIXES,
    VisionConfig,
)
from metrale_jax.models.vision import abstract_vision


def split_tensors(tensors: Mapping[str, np.ndarray]
                  ) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """(the text model's tensors under decoder-only names, the vision tower's and projector's
    under `vision.*` / `projector.*`); anything else (SigLIP's pooling head, CLIP's
    post-LayerNorm) is dropped."""
    text: dict[str, np.ndarray] = {}
    vision: dict[str, np.ndarray] = {}
    for name, value in tensors.items():
        for old, new in TEXT_PREFIXES:
            if name.startswith(old):
                text[new + name[len(old):]] = value
                break
        else:
            if name == "lm_head.weight":
                text[name] = value
            for prefix in VISION_PREFIXES:
                if name.startswith(prefix):
                    vision["vision." + name[len(prefix):]] = value
                    break
            for prefix in PROJECTOR_PREFIXES:
                if name.startswith(prefix):
                    vision["projector." + name[len(prefix):]] = value
    return text, vision


def _vision_specs(cfg: VisionConfig) -> dict[tuple[str, ...], tuple[str, Callable]]:
    """Our vision param path -> (HF tensor name, function from the HF tensor to ours);
    per-layer entries hold `{i}`."""
    E, H, D = cfg.hidden_size, cfg.num_heads, cfg.head_dim
    e, lay = "vision.embeddings.", "vision.encoder.layers.{i}."
    ident = lambda w: w  # noqa: E731
    specs: dict[tuple[str, ...], tuple[str, Callable]] = {
        ("patch_embed",): (e + "patch_embedding.weight", lambda w: w.transpose(2, 3, 1, 0)),
        ("position_embed",): (e + "position_embedding.weight", ident),
        ("proj_1",): ("projector.linear_1.weight", lambda w: w.T),
        ("proj_2",): ("projector.linear_2.weight", lambda w: w.T),
    }
    if cfg.tower == "siglip":
        specs[("patch_bias",)] = (e + "patch_embedding.bias", ident)
    else:
        specs[("class_embed",)] = (e + "class_embedding", ident)
        specs[("pre_norm", "weight")] = ("vision.pre_layrnorm.weight", ident)
        specs[("pre_norm", "bias")] = ("vision.pre_layrnorm.bias", ident)
    if cfg.projector_bias:
        specs[("proj_1_bias",)] = ("projector.linear_1.bias", ident)
        specs[("proj_2_bias",)] = ("projector.linear_2.bias", ident)
    layer = {
        ("attn", "q_proj"): ("self_attn.q_proj.weight", lambda w: w.T.reshape(E, H, D)),
        ("attn", "k_proj"): ("self_attn.k_proj.weight", lambda w: w.T.reshape(E, H, D)),
        ("attn", "v_proj"): ("self_attn.v_proj.weight", lambda w: w.T.reshape(E, H, D)),
        ("attn", "o_proj"): ("self_attn.out_proj.weight", lambda w: w.T.reshape(H, D, E)),
        ("attn", "q_bias"): ("self_attn.q_proj.bias", lambda b: b.reshape(H, D)),
        ("attn", "k_bias"): ("self_attn.k_proj.bias", lambda b: b.reshape(H, D)),
        ("attn", "v_bias"): ("self_attn.v_proj.bias", lambda b: b.reshape(H, D)),
        ("attn", "o_bias"): ("self_attn.out_proj.bias", ident),
        ("attn_norm", "weight"): ("layer_norm1.weight", ident),
        ("attn_norm", "bias"): ("layer_norm1.bias", ident),
        ("mlp_norm", "weight"): ("layer_norm2.weight", ident),
        ("mlp_norm", "bias"): ("layer_norm2.bias", ident),
        ("mlp", "fc1"): ("mlp.fc1.weight", lambda w: w.T),
        ("mlp", "fc1_bias"): ("mlp.fc1.bias", ident),
        ("mlp", "fc2"): ("mlp.fc2.weight", lambda w: w.T),
        ("mlp", "fc2_bias"): ("mlp.fc2.bias", ident),
    }
    specs.update({("layers", *path): (lay + name, fn) for path, (name, fn) in layer.items()})
    return specs


def assemble_vision(cfg: VisionConfig, tensors: Mapping[str, np.ndarray], source: Path | str,
                    dtype: Any = jnp.float32) -> tuple[nnx.GraphDef, nnx.State]:
    """Builds the `VisionEncoder`'s `(graphdef, params)` from `split_tensors`' vision half;
    `CheckpointError` naming `source` and the tensor when one is missing or misshapen."""
    graphdef, abstract = abstract_vision(cfg, dtype)
    want = nnx.to_pure_dict(abstract)
    out: dict = {}

    def take(name: str) -> np.ndarray:
        if name not in tensors:
            raise CheckpointError(f"{source}: tensor {name!r} is missing")
        return np.asarray(tensors[name], np.float32)

    for path, (pattern, fn) in _vision_specs(cfg).items():
        expected = want
        for key in path:
            expected = expected[key]
        if "{i}" in pattern:
            names = [pattern.format(i=i) for i in range(cfg.num_layers)]
            try:
                value = np.stack([fn(take(n)) for n in names])
            except ValueError:
                value = None
        else:
            names = [pattern]
            try:
                value = fn(take(pattern))
            except ValueError:
                value = None
        if value is None or tuple(value.shape) != tuple(expected.shape):
            raise CheckpointError(f"{source}: tensor {names[0]!r} does not fit the vision "
                                  f"config (expected {tuple(expected.shape)})")
        node = out
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = jnp.asarray(value, dtype)
    state = jax.tree.map(lambda x: x, abstract)
    nnx.replace_by_pure_dict(state, out)
    return graphdef, state


PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")
"""Where a folder keeps its image processor: the image processor's own file (transformers 4,
llava-hf's Hub folders), or transformers 5's processor file, which nests it under
`image_processor` (`LlavaProcessor.save_pretrained`)."""


def read_processor_config(folder: Path) -> dict[str, Any]:
    """The folder's image processor settings: `preprocessor_config.json`, else the
    `image_processor` entry of `processor_config.json` (`PROCESSOR_FILES`); `CheckpointError`
    when neither holds one."""
    for name in PROCESSOR_FILES:
        path = folder / name
        if not path.is_file():
            continue
        try:
            config = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{path}: not valid JSON ({e})") from None
        if name == "processor_config.json":
            config = config.get("image_processor") if isinstance(config, dict) else None
        if isinstance(config, dict):
            return config
    raise CheckpointError(f"{folder}: a vision-language model needs its image processor's "
                          "settings: preprocessor_config.json, or processor_config.json with "
                          "an image_processor entry")


__all__ = ["PROCESSOR_FILES", "assemble_vision", "read_processor_config", "split_tensors"]
