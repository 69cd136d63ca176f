"""Fixtures shared by the checkpoint-reader tests."""

from __future__ import annotations

from pathlib import Path

import pytest

CHECKPOINTS = Path(__file__).resolve().parents[2] / "checkpoints"
DEFAULT_GGUF = CHECKPOINTS / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="session")
def default_gguf_path() -> Path:
    """The default model's GGUF file; skips the test when it is not in checkpoints/."""
    if not DEFAULT_GGUF.is_file():
        pytest.skip(f"default model not found at {DEFAULT_GGUF} (see checkpoints/README.md)")
    return DEFAULT_GGUF
