"""`load_tokenizer`: which file of a checkpoint it picks, and its errors."""

from __future__ import annotations

import shutil

import pytest

from metrale_jax.errors import CheckpointError
from metrale_jax.text import HFTokenizer, SentencePieceTokenizer, load_tokenizer


def test_tokenizer_json_is_preferred_over_tokenizer_model(byte_level_folder, spm_model, tmp_path):
    shutil.copytree(byte_level_folder, tmp_path, dirs_exist_ok=True)
    shutil.copy(spm_model, tmp_path / "tokenizer.model")
    assert isinstance(load_tokenizer(tmp_path), HFTokenizer)
    (tmp_path / "tokenizer.json").unlink()
    assert isinstance(load_tokenizer(str(tmp_path)), SentencePieceTokenizer)


def test_a_folder_without_tokenizer_names_the_folder(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match=str(tmp_path)) as err:
        load_tokenizer(tmp_path)
    assert "tokenizer.json" in err.value.message and err.value.status == 400


def test_a_missing_path(tmp_path):
    with pytest.raises(CheckpointError, match="absent"):
        load_tokenizer(tmp_path / "absent")
