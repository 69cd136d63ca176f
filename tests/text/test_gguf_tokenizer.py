"""The GGUF byte-level vocabulary of the default model against transformers and llama.cpp."""

from __future__ import annotations

import copy
import logging

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Regex, pre_tokenizers

from metrale_jax.errors import CheckpointError, UnsupportedModelError
from metrale_jax.text import read_gguf_metadata, tokenizer_from_gguf_metadata
from metrale_jax.text.gguf_pretokenizers import PRE_TOKENIZERS
from metrale_jax.text.gguf_tokenizer import bytes_to_unicode
from tests.text.corpus import SMOLLM_SPECIAL_TEXTS, TEXTS

pytestmark = pytest.mark.default_model
ALL_TEXTS = TEXTS + SMOLLM_SPECIAL_TEXTS


@pytest.fixture(scope="module")
def smollm_reference(hf_smollm):
    """transformers' tokenizer with SmolLM2's own pre-tokenizer (its tokenizer.json: single
    digits, then GPT-2's byte-level split), which llama.cpp's "smollm" regexes reproduce."""
    reference = copy.deepcopy(hf_smollm)
    reference.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    return reference


def test_metadata_of_the_default_model(smollm, smollm_gguf):
    assert smollm.vocab_size == 49152
    assert smollm.eos_token == "<|im_end|>"
    assert smollm.eos_token_ids == (2,)
    assert (smollm.bos_token, smollm.bos_token_id) == ("<|im_start|>", 1)
    assert smollm.pad_token_id == 2
    assert smollm.add_bos is False
    assert smollm.special_ids == frozenset(range(17))  # the 17 control tokens
    assert smollm.is_special(0) and not smollm.is_special(17)
    assert smollm.chat_template and "<|im_start|>" in smollm.chat_template
    assert smollm.name == str(smollm_gguf)


@pytest.mark.parametrize("text", ALL_TEXTS)
def test_encode_matches_transformers(smollm, hf_smollm, text):
    assert smollm.encode(text) == hf_smollm.encode(text)
    assert smollm.encode(text, add_special_tokens=False) == hf_smollm.encode(
        text, add_special_tokens=False
    )


@pytest.mark.parametrize("text", ALL_TEXTS)
def test_decode_matches_transformers(smollm, hf_smollm, text):
    ids = hf_smollm.encode(text)
    assert smollm.decode(ids) == hf_smollm.decode(ids) == text
    assert smollm.decode(ids, skip_special_tokens=True) == hf_smollm.decode(
        ids, skip_special_tokens=True
    )


def test_special_tokens_in_text_are_single_ids(smollm):
    ids = smollm.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert smollm.convert_ids_to_tokens(ids[:3]) == ["<|im_start|>", "user", "Ċ"]
    assert smollm.decode(ids, skip_special_tokens=True) == "user\nhi"
    assert smollm.token_to_id("<|im_end|>") == 2
    assert smollm.token_to_id("not a token at all") is None
    assert smollm.convert_ids_to_tokens([10**6]) == [None]


# Ids llama.cpp gives for SmolLM2 (its "smollm" pre-tokenizer: each digit split off first).
LLAMA_CPP_IDS = {
    "Hello world! 123": [19556, 905, 17, 216, 33, 34, 35],
    "  multiple   spaces": [216, 2701, 256, 5600],
}


@pytest.mark.parametrize("text", sorted(LLAMA_CPP_IDS))
def test_encode_matches_llama_cpp(smollm, text):
    assert smollm.encode(text) == LLAMA_CPP_IDS[text]


def test_whitespace_before_digits_follows_the_model_not_transformers(
    smollm, hf_smollm, smollm_reference
):
    # transformers' GGUF loader drops SmolLM2's digit splitting, so two spaces before a digit
    # become "Ġ" "Ġ" there; the model's own tokenizer.json and llama.cpp give "ĠĠ".
    text = "a  1"
    assert smollm.encode(text) == smollm_reference.encode(text) == [81, 256, 33]
    assert hf_smollm.encode(text) == [81, 216, 216, 33]


@settings(max_examples=150, deadline=None)
@given(
    st.text(alphabet=st.characters(codec="utf-8"), max_size=40)
    | st.lists(
        st.sampled_from(
            ["  ", " ", "1", "23", "\n", "a", "é", "中", "😀", "<|im_end|>", "'s", "\t", "x  9"]
        ),
        max_size=12,
    ).map("".join)
)
def test_random_text_matches_the_model_tokenizer(smollm, smollm_reference, text):
    ids = smollm.encode(text)
    assert ids == smollm_reference.encode(text)
    # Not always `text`: SmolLM2's vocabulary lacks a few bytes (e.g. 0x80 after 0xF1).
    assert smollm.decode(ids) == smollm_reference.decode(ids)


def test_read_gguf_metadata_gives_python_values(smollm_meta):
    meta = smollm_meta
    assert meta["general.architecture"] == "llama"
    assert meta["tokenizer.ggml.model"] == "gpt2"
    assert meta["tokenizer.ggml.pre"] == "smollm"
    assert meta["tokenizer.ggml.tokens"][:2] == ["<|endoftext|>", "<|im_start|>"]
    assert meta["tokenizer.ggml.merges"][0] == "Ġ t"
    assert isinstance(meta["tokenizer.ggml.eos_token_id"], int)
    assert meta["tokenizer.ggml.add_bos_token"] is False


def test_missing_or_bad_files_raise_checkpoint_error(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        read_gguf_metadata(tmp_path / "absent.gguf")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all")
    with pytest.raises(CheckpointError, match="bad.gguf"):
        read_gguf_metadata(bad)


def _byte_vocab(pre: str | None, **extra) -> dict:
    """A byte-level vocabulary of the 256 single bytes (no merges) plus one control token."""
    tokens = ["<|end|>", *bytes_to_unicode().values()]
    meta = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [3] + [1] * 256,
        "tokenizer.ggml.merges": [],
        "tokenizer.ggml.eos_token_id": 0,
        **extra,
    }
    if pre is not None:
        meta["tokenizer.ggml.pre"] = pre
    return meta


@pytest.mark.parametrize("pre", sorted(PRE_TOKENIZERS))
def test_every_known_pre_tokenizer_round_trips(pre):
    tokenizer = tokenizer_from_gguf_metadata(_byte_vocab(pre))
    for text in TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert len(ids) == len(text.encode("utf-8"))  # one token per byte: nothing lost
        assert tokenizer.decode(ids) == text
    assert tokenizer.encode("x<|end|>")[-1] == 0


@pytest.mark.parametrize("pre", ["llama-bpe", "qwen2", "tekken", "gpt-4o"])
def test_split_regexes_agree_with_transformers(pre):
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS

    theirs = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(GGUF_PRE_TOKENIZER_SPLITS[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    ours = tokenizer_from_gguf_metadata(_byte_vocab(pre)).backend.pre_tokenizer
    for text in [*TEXTS, "I'M HERE'S 12345 x\r\n\n  y", "CamelCase HTTPServer it's"]:
        assert ours.pre_tokenize_str(text) == theirs.pre_tokenize_str(text)


def test_llama3_pre_adds_bos_by_default_and_the_file_overrides_it():
    meta = _byte_vocab("llama-bpe", **{"tokenizer.ggml.bos_token_id": 0})
    assert tokenizer_from_gguf_metadata(meta).add_bos is True
    meta["tokenizer.ggml.add_bos_token"] = False
    assert tokenizer_from_gguf_metadata(meta).add_bos is False


def test_unknown_pre_tokenizer_warns_and_uses_gpt2(caplog):
    with caplog.at_level(logging.WARNING):
        tokenizer = tokenizer_from_gguf_metadata(_byte_vocab("no-such-pre"))
    assert "no-such-pre" in caplog.text
    assert tokenizer.decode(tokenizer.encode("it's 12")) == "it's 12"


def test_end_of_turn_ids_join_eos_ids():
    meta = _byte_vocab("gpt2", **{"tokenizer.ggml.eot_token_id": 5})
    assert tokenizer_from_gguf_metadata(meta).eos_token_ids == (0, 5)


def test_unsupported_or_missing_vocabulary():
    with pytest.raises(UnsupportedModelError, match="'bert'"):
        tokenizer_from_gguf_metadata({**_byte_vocab("gpt2"), "tokenizer.ggml.model": "bert"})
    with pytest.raises(CheckpointError, match="tokenizer.ggml.tokens"):
        tokenizer_from_gguf_metadata({"tokenizer.ggml.model": "gpt2"})
    no_merges = _byte_vocab("gpt2")
    del no_merges["tokenizer.ggml.merges"]
    with pytest.raises(CheckpointError, match="merges"):
        tokenizer_from_gguf_metadata(no_merges)
