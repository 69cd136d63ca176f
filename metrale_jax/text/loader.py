"""Choosing and loading the tokenizer of a checkpoint.

`load_tokenizer(path)` takes a Hugging Face model folder (`tokenizer.json` preferred over
`tokenizer.model`, as transformers prefers the fast tokenizer) or a `.gguf` file (its embedded
vocabulary).
"""

from __future__ import annotations

import logging
from pathlib import Path

from metrale_jax.errors import CheckpointError
from metrale_jax.text.gguf_tokenizer import load_gguf_tokenizer
from metrale_jax.text.hf_tokenizer import TOKENIZER_JSON, load_hf_tokenizer
from metrale_jax.text.sentencepiece_tokenizer import (
    TOKENIZER_MODEL,
    load_sentencepiece_tokenizer,
)
from metrale_jax.text.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


def load_tokenizer(path: Path | str) -> Tokenizer:
    """The tokenizer of the checkpoint at `path`: a model folder or a `.gguf` file.

    Raises:
        CheckpointError: `path` does not exist, or the folder has neither `tokenizer.json` nor
            `tokenizer.model`, or the file found cannot be read.
    """
    path = Path(path)
    if path.is_file() and path.suffix.lower() == ".gguf":
        return load_gguf_tokenizer(path)
    if not path.is_dir():
        raise CheckpointError(f"tokenizer path {path} is neither a model folder nor a .gguf file")
    if (path / TOKENIZER_JSON).is_file():
        return load_hf_tokenizer(path)
    if (path / TOKENIZER_MODEL).is_file():
        return load_sentencepiece_tokenizer(path)
    raise CheckpointError(f"no tokenizer in {path}: expected {TOKENIZER_JSON} or {TOKENIZER_MODEL}")
