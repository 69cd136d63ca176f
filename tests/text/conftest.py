"""Fixtures of the text tests: the default model's GGUF and tiny tokenizers built on the fly."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.text import builders

REPO = Path(__file__).resolve().parents[2]
SMOLLM_GGUF = REPO / "checkpoints" / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="session")
def smollm_gguf() -> Path:
    """The default model's GGUF; tests that need it skip when it has not been fetched."""
    if not SMOLLM_GGUF.is_file():
        pytest.skip(f"default model {SMOLLM_GGUF} is absent (`make test` fetches it first)")
    return SMOLLM_GGUF


@pytest.fixture(scope="session")
def smollm_meta(smollm_gguf: Path) -> dict:
    """The GGUF's metadata, read once (reading it takes a couple of seconds)."""
    from metrale_jax.text import read_gguf_metadata

    return read_gguf_metadata(smollm_gguf)


@pytest.fixture(scope="session")
def smollm(smollm_gguf: Path, smollm_meta: dict):
    """Our tokenizer built from the GGUF's vocabulary."""
    from metrale_jax.text import tokenizer_from_gguf_metadata

    return tokenizer_from_gguf_metadata(smollm_meta, name=str(smollm_gguf))


@pytest.fixture(scope="session")
def hf_smollm(smollm_gguf: Path):
    """transformers' tokenizer of the same GGUF (slow to build: built once)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm_gguf.parent), gguf_file=smollm_gguf.name)


@pytest.fixture(scope="session")
def spm_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny byte-fallback SentencePiece BPE model file."""
    return builders.train_sentencepiece(tmp_path_factory.mktemp("spm"))


@pytest.fixture(scope="session")
def spm_folder(spm_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model folder holding only `tokenizer.model` and a Llama `tokenizer_config.json`."""
    folder = tmp_path_factory.mktemp("spm_folder")
    shutil.copy(spm_model, folder / "tokenizer.model")
    config = {"tokenizer_class": "LlamaTokenizer", "add_bos_token": True}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="session")
def byte_level_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny GPT-2-style `tokenizer.json` folder."""
    return builders.build_byte_level_folder(tmp_path_factory.mktemp("byte_level"))


@pytest.fixture(scope="session")
def llama_style_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama-2-style (byte-fallback) `tokenizer.json` folder."""
    return builders.build_llama_style_folder(tmp_path_factory.mktemp("llama_style"))
