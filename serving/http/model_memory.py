"""What a model holds on its devices, known before its weights are read: the placement hook
that records a runtime's footprint from its memory plan and asks the model pool for room
(serving/http/model_pool.py), the bounded KV pool of a model that shares its device, and the
size of a checkpoint's weight files."""

from __future__ import annotations

import dataclasses
from typing import Any


class AdmittedPlacement:
    """`PlacementHook` that records the runtime's `footprint` once the memory plan is made;
    for a runtime in a model pool (with `admit`), the KV pool is bounded first (every slot
    holding max_len, unless `num_pages` is configured) and `admit` is asked for the bytes per
    device, before any weight is read."""

    def __init__(self, config: Any, runtime: Any):
        from metrale_jax.engine.placement import PlacementHook
        self._hook = PlacementHook(config)
        self.config = config
        self._runtime = runtime

    @property
    def placement(self) -> Any:
        """The engine's `Placement` (None until called)."""
        return self._hook.placement

    def __call__(self, model_config: Any, dtype: str) -> Any:
        shardings = self._hook(model_config, dtype)
        runtime = self._runtime
        if runtime.admit is not None and self.config.num_pages is None:
            # other models share the device: the KV pool does not fill it
            self._hook.placement = bounded_placement(self._hook.placement)
        runtime.footprint = self._hook.placement.device_bytes
        if runtime.admit is not None:
            runtime.admit(runtime.footprint)
        return shardings


def bounded_placement(placement: Any) -> Any:
    """`placement` with a KV page pool of every slot holding max_len (plus the null page)
    rather than the whole device's memory: a model of a pool shares the device."""
    resolved = placement.config
    return dataclasses.replace(placement, config=dataclasses.replace(
        resolved, num_pages=resolved.max_slots * resolved.pages_per_seq + 1))


def weights_bytes(model: str) -> int:
    """The size of a checkpoint's weight files (safetensors, GGUF, PyTorch), an estimate of
    the memory its weights take; 0 when the files cannot be found."""
    from pathlib import Path

    from metrale_jax.weights.checkpoint import resolve
    try:
        path, _ = resolve(model)
    except Exception:
        return 0
    path = Path(path)
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for pattern in ("*.safetensors", "*.gguf", "*.bin")
               for f in path.rglob(pattern))
