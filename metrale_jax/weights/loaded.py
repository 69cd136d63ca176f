"""`Checkpoint`: a loaded model, the one record every checkpoint reader returns.

Below both `checkpoint.py` (which resolves a name and picks the reader) and the readers that
build one (`orbax_store.py`), so neither imports the other for it; imports only config.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Literal

from flax import nnx

from metrale_jax.config import ModelConfig

Format = Literal["hf", "gguf", "orbax"]

SAMPLING_DEFAULT_KEYS: dict[str, type] = {"temperature": float, "top_p": float, "top_k": int,
                                          "min_p": float, "repetition_penalty": float}
"""The `generation_config.json` fields that become request defaults (`Checkpoint.
sampling_defaults`), with their types."""


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """A loaded model: everything the engine and the text layer need.

    gguf_metadata: for a GGUF source, its key-value metadata (kept so `convert` can store the
    tokenizer); None otherwise.
    vision: a vision-language model's `models.vision.VisionEncoder`, split (graphdef,
    params); image_processor: its `preprocessor_config.json`. None for text-only models.

    graphdef/params: the split NNX `Transformer` (params on the default device, in `dtype`).
    tokenizer: a `metrale_jax.text.Tokenizer`; chat_template: its source or None.
    generation_config: defaults from the checkpoint (eos ids, temperature, ...).
    """

    name: str
    path: Path
    format: Format
    config: ModelConfig
    graphdef: nnx.GraphDef
    params: nnx.State
    tokenizer: Any
    chat_template: str | None
    generation_config: dict[str, Any]
    dtype: str
    gguf_metadata: dict[str, Any] | None = None
    vision: tuple[nnx.GraphDef, nnx.State] | None = None
    image_processor: dict[str, Any] | None = None

    @property
    def sampling_defaults(self) -> dict[str, Any]:
        """The sampling fields the checkpoint's `generation_config.json` sets
        (`SAMPLING_DEFAULT_KEYS`: temperature, top_p, top_k, min_p, repetition_penalty), as
        numbers: the server's defaults for a request that leaves them out, as vLLM's
        `--generation-config auto` applies them. Empty for a checkpoint without them (a
        GGUF, most tiny models)."""
        out: dict[str, Any] = {}
        for key, kind in SAMPLING_DEFAULT_KEYS.items():
            value = self.generation_config.get(key)
            if isinstance(value, int | float) and not isinstance(value, bool):
                out[key] = kind(value)
        return out

    @property
    def num_params(self) -> int:
        """The number of stored param elements: the parameters of a float model; a quantized
        one's packed codes and scales count as stored (`weights/catalog.py` counts the
        float model's parameters)."""
        import jax
        return sum(x.size for x in jax.tree.leaves(self.params))
