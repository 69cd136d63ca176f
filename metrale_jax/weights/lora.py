"""LoRA adapters in the PEFT format: read, checked against the base model, as per-layer arrays.

A PEFT adapter folder holds `adapter_config.json` (`r`, `lora_alpha`, `use_rslora`,
`target_modules`, ...) and `adapter_model.safetensors` with, for each adapted linear layer of
each decoder layer i, `base_model.model.model.layers.{i}.<part>.<module>.lora_A.weight`
`[r, in]` and `...lora_B.weight` `[out, r]` (PyTorch's [out, in] convention). The adapted
output is `y = x W + scale * (x A^T) B^T` with `scale = lora_alpha / r` (`lora_alpha / sqrt(r)`
with `use_rslora`).

`load_peft_adapter` returns a `LoraAdapter`: for each target module (the canonical names of
`MODULES`) `a: [L, in, r]` and `b: [L, r, out]` in float32, x-major like the model's own params
(`x @ a @ b`), layers the adapter leaves out filled with zeros. What this server cannot apply
is refused at load time with an error naming the cause: DoRA, `modules_to_save`, LoRA biases,
per-module rank or alpha patterns, a module outside the attention and MLP projections, and any
shape that does not fit the base model (naming the module).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path

import numpy as np

from metrale_jax.config import ModelConfig
from metrale_jax.errors import InvalidParameterError
from metrale_jax.models.lora import MODULES, module_shape

_KEY = re.compile(
    r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.\w+)?\.weight$")


class LoraError(InvalidParameterError):
    """An adapter this server cannot load (HTTP 400 when loaded through the API)."""

    def __init__(self, message: str, param: str | None = "lora_path"):
        super().__init__(message, param=param)


@dataclasses.dataclass(frozen=True)
class LoraAdapter:
    """One adapter's weights, per target module: `weights[m] = (a [L, in, r], b [L, r, out])`
    float32; `scale` multiplies `x @ a @ b`; `rank` r; `name` and `path` for listings."""

    name: str
    path: str
    rank: int
    scale: float
    weights: dict[str, tuple[np.ndarray, np.ndarray]]

    @property
    def targets(self) -> tuple[str, ...]:
        """The adapted modules, in `MODULES` order."""
        return tuple(m for m in MODULES if m in self.weights)


def _config(folder: Path) -> dict:
    path = folder / "adapter_config.json"
    if not path.is_file():
        raise LoraError(f"{folder} is not a PEFT adapter: it has no adapter_config.json")
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise LoraError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise LoraError(f"{path} is not a JSON object")
    kind = config.get("peft_type", "LORA")
    if str(kind).upper() != "LORA":
        raise LoraError(f"{folder}: a {kind} adapter; only LoRA adapters are served")
    if config.get("use_dora"):
        raise LoraError(f"{folder}: DoRA adapters (use_dora) are not supported")
    if config.get("modules_to_save"):
        raise LoraError(f"{folder}: modules_to_save {config['modules_to_save']} would replace "
                        "whole base-model modules; not supported")
    if config.get("bias", "none") != "none" or config.get("lora_bias"):
        raise LoraError(f"{folder}: LoRA biases (bias={config.get('bias')!r}) are not supported")
    if config.get("fan_in_fan_out"):
        raise LoraError(f"{folder}: fan_in_fan_out adapters (Conv1D layers) are not supported")
    for field in ("rank_pattern", "alpha_pattern"):
        if config.get(field):
            raise LoraError(f"{folder}: per-module ranks or alphas ({field}) are not supported")
    r = config.get("r")
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise LoraError(f"{folder}: r must be a positive integer, not {r!r}")
    alpha = config.get("lora_alpha", r)
    if isinstance(alpha, bool) or not isinstance(alpha, int | float):
        raise LoraError(f"{folder}: lora_alpha must be a number, not {alpha!r}")
    return config


def load_peft_adapter(path: str | Path, cfg: ModelConfig, name: str | None = None,
                      max_rank: int | None = None) -> LoraAdapter:
    """Reads the PEFT adapter in folder `path` for a base model of architecture `cfg`.

    Raises `LoraError` (naming the cause, and the module for a shape or name that does not
    fit) for what cannot be served; `max_rank`: the largest rank accepted (None: any).
    """
    from safetensors.numpy import load_file

    folder = Path(path)
    if not folder.is_dir():
        raise LoraError(f"no adapter folder at {folder}")
    config = _config(folder)
    r = int(config["r"])
    if max_rank is not None and r > max_rank:
        raise LoraError(f"{folder}: rank {r} exceeds this server's maximum LoRA rank "
                        f"{max_rank} (--max-lora-rank)")
    scale = float(config.get("lora_alpha", r)) / (math.sqrt(r) if config.get("use_rslora")
                                                   else r)
    weights_path = folder / "adapter_model.safetensors"
    if not weights_path.is_file():
        raise LoraError(f"{folder} has no adapter_model.safetensors (a .bin adapter? convert "
                        "it with PEFT's save_pretrained(safe_serialization=True))")
    try:
        tensors = load_file(str(weights_path))
    except Exception as e:  # a truncated or foreign file
        raise LoraError(f"{weights_path} cannot be read: {e}") from None
    L = cfg.num_layers
    found: dict[str, dict[int, dict[str, np.ndarray]]] = {}
    for key, value in tensors.items():
        m = _KEY.search(key)
        if m is None:
            raise LoraError(f"{folder}: tensor {key!r} is not a LoRA weight of an attention or "
                            "MLP projection (only those can be adapted)")
        layer, module, part = int(m.group(1)), m.group(2), m.group(3)
        if module not in MODULES:
            raise LoraError(f"{folder}: module {module!r} cannot be adapted (only "
                            f"{', '.join(MODULES)})")
        if layer >= L:
            raise LoraError(f"{folder}: layer {layer} of {module}, but the base model has {L} "
                            "layers")
        found.setdefault(module, {}).setdefault(layer, {})[part] = np.asarray(value,
                                                                            np.float32)
    if not found:
        raise LoraError(f"{folder}: adapter_model.safetensors holds no LoRA weights")
    weights = {}
    for module in MODULES:
        if module not in found:
            continue
        fan_in, fan_out = module_shape(cfg, module)
        a = np.zeros((L, fan_in, r), np.float32)
        b = np.zeros((L, r, fan_out), np.float32)
        for layer, parts in found[module].items():
            if set(parts) != {"A", "B"}:
                raise LoraError(f"{folder}: layer {layer} of {module} lacks lora_"
                                f"{'B' if 'A' in parts else 'A'}")
            A, B = parts["A"], parts["B"]
            if A.shape != (r, fan_in) or B.shape != (fan_out, r):
                raise LoraError(
                    f"{folder}: {module} of layer {layer} has lora_A {tuple(A.shape)} and "
                    f"lora_B {tuple(B.shape)}, but this base model needs ({r}, {fan_in}) and "
                    f"({fan_out}, {r}): the adapter was made for another model")
            a[layer], b[layer] = A.T, B.T
        weights[module] = (a, b)
    return LoraAdapter(name or folder.name, str(folder), r, scale, weights)
