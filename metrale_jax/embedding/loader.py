"""Which task a model is served for, and loading a pooling model as its `Pooler`.

`pooling_task(model, task)`: "embed", "score" or None (a model that generates text), from the
request of the user (`--task`) and the model's files:
- an encoder folder (BERT, RoBERTa, XLM-RoBERTa: `weights/encoder_reader.py`) embeds, or
  scores pairs when it is a `*ForSequenceClassification` (a cross-encoder);
- a decoder folder embeds when it carries a sentence-transformers `modules.json` with a
  Pooling module (Qwen3-Embedding), scores when its config says it is a reranker (see
  `decoder_pooler.decoder_pooling_task`); anything else generates.
`--task embed` / `--task score` on a decoder model asks for it; `--task generate` on an
encoder is refused (an encoder generates nothing).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from metrale_jax.embedding.pooler import Pooler, Task
from metrale_jax.errors import InvalidParameterError
from metrale_jax.weights.checkpoint import resolve

TASKS = ("auto", "generate", "embed", "score")
"""The values of `--task`."""


def pooling_task(model: str | Path, task: str = "auto") -> Task | None:
    """The pooling task model `model` is served for ("embed" | "score"), or None when it
    generates text. Raises `InvalidParameterError` for a task the model cannot do."""
    from metrale_jax.embedding.decoder_pooler import decoder_pooling_task
    from metrale_jax.weights.encoder_reader import encoder_task, is_encoder_folder
    if task not in TASKS:
        raise InvalidParameterError(f"task {task!r} is not one of {', '.join(TASKS)}",
                                    param="task")
    path, fmt = resolve(model)
    if fmt == "hf" and is_encoder_folder(path):
        own = encoder_task(path)
        if task == "generate":
            raise InvalidParameterError(
                f"{path} is an encoder ({'cross-encoder' if own == 'score' else 'embedding'} "
                "model): it generates no text; serve it with --task auto", param="task")
        if task not in ("auto", own):
            raise InvalidParameterError(
                f"{path} is a{' cross-encoder' if own == 'score' else 'n embedding model'}: "
                f"it serves --task {own}, not {task}", param="task")
        return own
    if task == "generate":
        return None
    if task in ("embed", "score"):
        return task  # type: ignore[return-value]
    return decoder_pooling_task(path) if fmt == "hf" else None


def load_pooler(model: str | Path, task: Task, *, dtype: str | None = None,
                max_slots: int | None = None, max_len: int | None = None,
                engine_options: dict[str, Any] | None = None) -> Pooler:
    """Loads `model` as the `Pooler` of `task` (what `pooling_task` said): an encoder's own
    bucketed programs, or a decoder through an engine and scheduler of `max_slots` rows,
    `max_len` positions and `engine_options`."""
    from metrale_jax.embedding.decoder_pooler import load_decoder_pooler
    from metrale_jax.embedding.encoder_pooler import load_encoder_pooler
    from metrale_jax.weights.encoder_reader import is_encoder_folder
    path, fmt = resolve(model)
    if fmt == "hf" and is_encoder_folder(path):
        return load_encoder_pooler(path, dtype=dtype or "float32")
    return load_decoder_pooler(path, task, dtype=dtype, max_slots=max_slots, max_len=max_len,
                               **(engine_options or {}))
