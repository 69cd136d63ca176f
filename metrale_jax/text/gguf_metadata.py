"""Reading the key/value metadata of a GGUF file as plain Python values.

`read_gguf_metadata(path)` returns e.g. `{"general.architecture": "llama",
"tokenizer.ggml.tokens": ["<|endoftext|>", ...], "tokenizer.ggml.bos_token_id": 1, ...}`:
strings as `str`, numbers as `int`/`float`/`bool`, arrays as lists. The tensors are not read
(the file is memory-mapped, and only the header is touched).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from metrale_jax.errors import CheckpointError

logger = logging.getLogger(__name__)


def _field_value(name: str, field: Any) -> Any:
    try:
        return field.contents()
    except UnicodeDecodeError:
        # A few converters wrote tokens that are not valid UTF-8; keep them readable.
        logger.warning("GGUF key %s holds invalid UTF-8; replacing the bad bytes", name)

        def text(part: Any) -> str:
            return bytes(part).decode("utf-8", errors="replace")

        if len(field.types) > 1:  # an array of strings
            return [text(field.parts[i]) for i in field.data]
        return text(field.parts[-1])


def read_gguf_metadata(path: Path | str) -> dict[str, Any]:
    """All metadata keys of the GGUF file at `path`, mapped to plain Python values.

    Raises:
        CheckpointError: the file is missing or is not a readable GGUF file.
    """
    import gguf  # imported here: the package is heavy and only GGUF users need it

    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path} does not exist")
    try:
        reader = gguf.GGUFReader(str(path), "r")
    except Exception as err:  # the reader raises ValueError, struct.error, OSError, ...
        raise CheckpointError(f"cannot read GGUF file {path}: {err}") from err
    metadata = {name: _field_value(name, field) for name, field in reader.fields.items()}
    logger.debug("read %d GGUF metadata keys from %s", len(metadata), path)
    return metadata
