"""The `tokenizer.json` backend against `transformers.AutoTokenizer` on the same folder."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from metrale_jax.errors import CheckpointError
from metrale_jax.text import HFTokenizer, load_hf_tokenizer, load_tokenizer
from tests.text.builders import CHAT_TEMPLATE, write_json
from tests.text.corpus import SMOLLM_SPECIAL_TEXTS, TEXTS

BYTE_LEVEL_TEXTS = [*TEXTS, *SMOLLM_SPECIAL_TEXTS, "<|im_start|>a<think>b<|im_end|>"]
LLAMA_TEXTS = [*TEXTS, "<s>x</s> y<unk>", "</s></s>z", "a<s>b"]


def assert_same_as_transformers(ours, hf, texts: list[str]) -> None:
    """encode (with and without special tokens) and decode (with and without skipping)."""
    for text in texts:
        ids = hf.encode(text)
        assert ours.encode(text) == ids, text
        assert ours.encode(text, add_special_tokens=False) == hf.encode(
            text, add_special_tokens=False
        ), text
        for skip in (False, True):
            assert ours.decode(ids, skip) == hf.decode(ids, skip_special_tokens=skip), text


@pytest.mark.default_model
def test_saved_transformers_tokenizer_of_the_default_model(hf_smollm, smollm, tmp_path):
    hf_smollm.save_pretrained(tmp_path)
    ours = load_tokenizer(tmp_path)
    assert isinstance(ours, HFTokenizer)
    assert_same_as_transformers(
        ours, AutoTokenizer.from_pretrained(str(tmp_path)), [*TEXTS, *SMOLLM_SPECIAL_TEXTS]
    )
    assert ours.chat_template == smollm.chat_template
    assert (ours.eos_token_ids, ours.bos_token_id, ours.special_ids) == (
        smollm.eos_token_ids,
        smollm.bos_token_id,
        smollm.special_ids,
    )


@pytest.fixture(scope="module")
def byte_level(byte_level_folder):
    return load_hf_tokenizer(byte_level_folder), AutoTokenizer.from_pretrained(
        str(byte_level_folder)
    )


def test_byte_level_bpe_matches_transformers(byte_level):
    assert_same_as_transformers(*byte_level, BYTE_LEVEL_TEXTS)


def test_byte_level_side_files_are_read(byte_level):
    ours, hf = byte_level
    assert ours.vocab_size == len(hf) == 701
    assert ours.token_to_id("<think>") == 700 and not ours.is_special(700)
    assert ours.encode("a<think>b", add_special_tokens=False)[1] == 700
    assert ours.special_ids == {0, 1, 2}
    assert ours.eos_token == "<|im_end|>"
    assert ours.eos_token_ids == (2, 0)  # tokenizer_config's eos, then generation_config's
    assert ours.pad_token_id == 0
    assert ours.chat_template == CHAT_TEMPLATE == hf.chat_template
    # As in transformers 5, add_bos_token in the config does not override tokenizer.json.
    assert ours.add_bos is False and hf.encode("x") == ours.encode("x")


@pytest.fixture(scope="module")
def llama_style(llama_style_folder):
    return load_hf_tokenizer(llama_style_folder), AutoTokenizer.from_pretrained(
        str(llama_style_folder)
    )


def test_llama_style_byte_fallback_bpe_matches_transformers(llama_style):
    assert_same_as_transformers(*llama_style, LLAMA_TEXTS)


def test_llama_style_metadata(llama_style):
    ours, _ = llama_style
    assert ours.add_bos is True and ours.encode("x")[0] == ours.bos_token_id == 1
    assert ours.special_ids == {0, 1, 2}
    assert ours.token_to_id("<0x0A>") == 3 + 0x0A
    ids = ours.encode("𝄞", add_special_tokens=False)  # never seen in training: four bytes
    assert ours.convert_ids_to_tokens(ids)[-4:] == ["<0xF0>", "<0x9D>", "<0x84>", "<0x9E>"]
    assert ours.decode(ids) == "𝄞"


def test_bad_bytes_decode_per_byte_where_transformers_blanks_the_run(llama_style):
    ours, hf = llama_style
    run = [3 + b for b in (0xE4, 0xBD, 0xA0, 0xE5, 0xA5, 0xBD)]  # "你好" as six byte tokens
    assert ours.decode(run) == hf.decode(run) == "你好"
    a = ours.token_to_id("▁a")
    cut = [*run[:4], a, 3 + 0xFF, 3 + 0x41]
    assert ours.decode(cut) == "你\ufffd a\ufffdA"
    assert hf.decode(cut) == "\ufffd" * 4 + " a" + "\ufffd" * 2  # whole runs blanked
    assert ours.decode([1, *cut, 2], skip_special_tokens=True) == "你\ufffd a\ufffdA"


def test_special_tokens_map_and_template_list(byte_level_folder, tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    shutil.copy(byte_level_folder / "tokenizer.json", folder)
    write_json(
        folder / "special_tokens_map.json",
        {
            "eos_token": {"content": "<|endoftext|>", "lstrip": False},
            "bos_token": "<|im_start|>",
        },
    )
    write_json(
        folder / "tokenizer_config.json",
        {
            "eos_token": "<|im_end|>",  # the config wins over the map
            "chat_template": [
                {"name": "tool_use", "template": "T"},
                {"name": "default", "template": "D"},
            ],
        },
    )
    ours = load_hf_tokenizer(folder)
    assert (ours.eos_token, ours.bos_token) == ("<|im_end|>", "<|im_start|>")
    assert ours.chat_template == "D"


def test_broken_files_raise_checkpoint_error_naming_them(byte_level_folder, tmp_path):
    with pytest.raises(CheckpointError, match="tokenizer.json"):
        load_hf_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="tokenizer.json"):
        load_hf_tokenizer(tmp_path)
    shutil.copy(byte_level_folder / "tokenizer.json", tmp_path)
    (tmp_path / "tokenizer_config.json").write_text("[1, 2]")
    with pytest.raises(CheckpointError, match="tokenizer_config.json"):
        load_hf_tokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"added_tokens_decoder": {"x": {}}}))
    with pytest.raises(CheckpointError, match="added_tokens_decoder"):
        load_hf_tokenizer(Path(tmp_path))


def test_a_lone_surrogate_is_a_clear_error_not_a_type_error(byte_level, spm_folder):
    """`encode` of text holding a lone surrogate raises `InvalidParameterError` (a 400 in the
    server, a clear error in the Python API) from every backend; a paired one encodes."""
    from metrale_jax.errors import InvalidParameterError
    from metrale_jax.text import load_tokenizer

    for tokenizer in (byte_level[0], load_tokenizer(spm_folder)):
        with pytest.raises(InvalidParameterError, match="surrogate.*U\\+DC00 at character 2"):
            tokenizer.encode("ab\udc00c")
        assert tokenizer.encode("ab\U0001F600c")
