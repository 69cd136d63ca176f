"""A SentencePiece vocabulary stored in a GGUF ("llama" kind) against sentencepiece itself."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import sentencepiece as spm

from metrale_jax.text import load_tokenizer, read_gguf_metadata, tokenizer_from_gguf_metadata
from tests.text.corpus import TEXTS

TEMPLATE = "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{% endfor %}"


def _token_type(sp: spm.SentencePieceProcessor, i: int) -> int:
    if sp.is_unknown(i):
        return 2
    if sp.is_control(i):
        return 3
    if sp.is_byte(i):
        return 6
    if sp.is_unused(i):
        return 5
    return 1


def write_spm_gguf(sp: spm.SentencePieceProcessor, path: Path, **flags) -> Path:
    """A GGUF holding only `sp`'s vocabulary (tokens, scores, types) and one dummy tensor."""
    writer = gguf.GGUFWriter(str(path), arch="llama")
    size = sp.get_piece_size()
    writer.add_tokenizer_model("llama")
    writer.add_token_list([sp.id_to_piece(i) for i in range(size)])
    writer.add_token_scores([sp.get_score(i) for i in range(size)])
    writer.add_token_types([_token_type(sp, i) for i in range(size)])
    writer.add_bos_token_id(sp.bos_id())
    writer.add_eos_token_id(sp.eos_id())
    writer.add_unk_token_id(sp.unk_id())
    writer.add_chat_template(TEMPLATE)
    for name, value in flags.items():
        getattr(writer, f"add_{name}")(value)
    writer.add_tensor("token_embd.weight", np.zeros((2, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def sp(spm_model: Path) -> spm.SentencePieceProcessor:
    return spm.SentencePieceProcessor(model_file=str(spm_model))


@pytest.fixture(scope="module")
def gguf_path(sp, tmp_path_factory) -> Path:
    return write_spm_gguf(sp, tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf")


@pytest.fixture(scope="module")
def tokenizer(gguf_path):
    return load_tokenizer(gguf_path)


def test_metadata_round_trips_through_the_file(gguf_path, sp):
    meta = read_gguf_metadata(gguf_path)
    assert meta["tokenizer.ggml.model"] == "llama"
    assert meta["tokenizer.ggml.tokens"][:3] == ["<unk>", "<s>", "</s>"]
    assert meta["tokenizer.ggml.scores"][10] == pytest.approx(sp.get_score(10))
    assert meta["tokenizer.ggml.token_type"][:4] == [2, 3, 3, 6]
    assert meta["tokenizer.chat_template"] == TEMPLATE


def test_special_tokens_and_defaults(tokenizer, sp):
    assert tokenizer.vocab_size == sp.get_piece_size()
    assert (tokenizer.bos_token, tokenizer.bos_token_id) == ("<s>", 1)
    assert (tokenizer.eos_token, tokenizer.eos_token_ids) == ("</s>", (2,))
    assert tokenizer.add_bos is True  # llama.cpp's default for SentencePiece vocabularies
    assert tokenizer.special_ids == {0, 1, 2}
    assert tokenizer.chat_template == TEMPLATE


@pytest.mark.parametrize("text", TEXTS)
def test_encode_and_decode_match_sentencepiece(tokenizer, sp, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert ids == sp.encode(text)
    assert tokenizer.encode(text) == [1, *ids]
    assert tokenizer.decode(ids) == sp.decode(ids)


def test_emoji_outside_the_vocabulary_falls_back_to_bytes(tokenizer, sp):
    ids = tokenizer.encode("𝄞", add_special_tokens=False)  # a character never seen in training
    pieces = tokenizer.convert_ids_to_tokens(ids)
    assert pieces == ["▁", "<0xF0>", "<0x9D>", "<0x84>", "<0x9E>"]
    assert ids == sp.encode("𝄞")
    assert tokenizer.decode(ids) == "𝄞"


def test_text_after_a_special_token_gets_the_space_prefix_as_in_llama_cpp(tokenizer, sp):
    ids = tokenizer.encode("<s>Hello</s>world", add_special_tokens=False)
    assert ids == [1, *sp.encode("Hello"), 2, *sp.encode("world")]
    assert tokenizer.decode(ids, skip_special_tokens=True) == sp.decode(ids)


def test_flags_in_the_file_are_honoured(sp, tmp_path):
    path = write_spm_gguf(sp, tmp_path / "flags.gguf", add_bos_token=False, add_space_prefix=False)
    tokenizer = tokenizer_from_gguf_metadata(read_gguf_metadata(path))
    assert tokenizer.add_bos is False
    ids = tokenizer.encode("Hello world")
    assert tokenizer.convert_ids_to_tokens(ids)[0] != sp.id_to_piece(sp.encode("Hello")[0])
    assert tokenizer.decode(ids) == "Hello world"
