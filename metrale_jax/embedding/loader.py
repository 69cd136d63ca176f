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

ENCODER_MAX_ROWS = 64
"""The most inputs one encoder program runs, by default."""

ENCODER_TOKEN_BUDGET = 8192
"""The most R * S tokens of one encoder program, by default."""


def pooling_task(model: str | Path, task: str = "auto") -> Task | None:
    """The pooling task model `model` is served for ("embed" | "score"), or None when it
    generates text. Raises `InvalidParameterError` for a task the model cannot do."""
    from metrale_jax.weights.encoder_reader import is_encoder_folder, read_encoder_setup
    if task not in TASKS:
        raise InvalidParameterError(f"task {task!r} is not one of {', '.join(TASKS)}",
                                    param="task")
    path, fmt = resolve(model)
    if fmt == "hf" and is_encoder_folder(path):
        own: Task = "score" if read_encoder_setup(path).cross_encoder else "embed"
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
    if fmt != "hf":
        return None
    from metrale_jax.embedding.decoder_pooler import decoder_pooling_task
    return decoder_pooling_task(path)


def load_pooler(model: str | Path, task: Task, *, dtype: str | None = None,
                max_slots: int | None = None, max_len: int | None = None,
                engine_options: dict[str, Any] | None = None) -> Pooler:
    """Loads `model` as the `Pooler` of `task` (what `pooling_task` said): an encoder's own
    bucketed programs, or a decoder through an engine and scheduler of `max_slots` rows,
    `max_len` positions and `engine_options`.

    An encoder's grid: `engine_options` "max_rows" (the most inputs one program runs,
    default `ENCODER_MAX_ROWS`) and "token_budget" (the most R * S tokens of one program,
    default `ENCODER_TOKEN_BUDGET`); `max_len` caps its length buckets below the model's
    limit. Its other engine options are ignored (an encoder has no KV cache)."""
    from metrale_jax.engine.config import EngineConfig
    from metrale_jax.weights.encoder_reader import is_encoder_folder
    options = dict(engine_options or {})
    path, fmt = resolve(model)
    if fmt == "hf" and is_encoder_folder(path):
        from metrale_jax.embedding.encoder_pooler import load_encoder_pooler
        return load_encoder_pooler(
            path, dtype=dtype or "float32", max_len=max_len,
            max_rows=int(options.get("max_rows", ENCODER_MAX_ROWS)),
            token_budget=int(options.get("token_budget", ENCODER_TOKEN_BUDGET)),
            compilation_cache_dir=options.get("compilation_cache_dir",
                                              EngineConfig().compilation_cache_dir))
    from metrale_jax.embedding.decoder_pooler import load_decoder_pooler
    # compiled by the caller's `warmup()` (the whole grid), not while loading
    return load_decoder_pooler(path, task, dtype=dtype or "float32", warmup="none",
                               max_slots=max_slots, max_len=max_len, **options)
