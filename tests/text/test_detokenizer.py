"""The incremental detokenizer: its stream adds up to `decode(all)` and never cuts a character."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from metrale_jax.text import (
    IncrementalDetokenizer,
    Tokenizer,
    load_tokenizer,
    tokenizer_from_gguf_metadata,
)
from tests.text.test_gguf_llama import write_spm_gguf

HYPOTHESIS = settings(
    max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


def stream(
    tokenizer: Tokenizer, ids: Sequence[int], skip: bool = False, prompt: Sequence[int] = ()
) -> list[str]:
    """Push every id; check each partial text is a prefix of the final one; return deltas."""
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip, prompt_ids=prompt)
    deltas = [detok.push(i) for i in ids]
    deltas.append(detok.flush())
    full = "".join(deltas)
    sent = ""
    for delta in deltas:
        sent += delta
        assert full.startswith(sent)
    assert detok.text == full
    return deltas


def check_stream(tokenizer: Tokenizer, ids: Sequence[int], skip: bool) -> None:
    """The stream's text is exactly decode(ids), and a U+FFFD it sends is final."""
    expected = tokenizer.decode(ids, skip_special_tokens=skip)
    deltas = stream(tokenizer, ids, skip)
    assert "".join(deltas) == expected
    position = 0
    for delta in deltas:
        for offset, char in enumerate(delta):
            if char == "\ufffd":
                assert expected[position + offset] == "\ufffd"
        position += len(delta)


@pytest.fixture(scope="module")
def gguf_llama(spm_model, tmp_path_factory):
    """The tiny SentencePiece vocabulary rebuilt from GGUF (tokenizers' ByteFallback decoder)."""
    import sentencepiece as spm

    from metrale_jax.text import read_gguf_metadata

    sp = spm.SentencePieceProcessor(model_file=str(spm_model))
    path = write_spm_gguf(sp, tmp_path_factory.mktemp("detok") / "v.gguf")
    return tokenizer_from_gguf_metadata(read_gguf_metadata(path))


@pytest.fixture(params=["smollm", "llama_style", "sentencepiece", "gguf_llama"])
def tokenizer(request) -> Tokenizer:
    """Each backend: byte-level BPE, HF byte-fallback BPE, SentencePiece, GGUF SentencePiece."""
    if request.param == "llama_style":
        return load_tokenizer(request.getfixturevalue("llama_style_folder"))
    if request.param == "sentencepiece":
        return load_tokenizer(request.getfixturevalue("spm_folder"))
    return request.getfixturevalue(request.param)


def _interesting_ids(tokenizer: Tokenizer) -> list[int]:
    """Special ids, byte tokens (byte-fallback ones, or GPT-2's one-byte tokens)."""
    ids = set(tokenizer.special_ids)
    ids |= {i for i in (tokenizer.token_to_id(f"<0x{b:02X}>") for b in range(256)) if i is not None}
    if not ids - set(tokenizer.special_ids):
        from metrale_jax.text.gguf_tokenizer import bytes_to_unicode

        ids |= {
            i for c in bytes_to_unicode().values() if (i := tokenizer.token_to_id(c)) is not None
        }
    return sorted(ids)


@HYPOTHESIS
@given(data=st.data(), skip=st.booleans())
def test_random_ids_stream_to_decode(tokenizer, data, skip):
    interesting = _interesting_ids(tokenizer)
    token = st.integers(0, tokenizer.vocab_size - 1) | st.sampled_from(interesting)
    check_stream(tokenizer, data.draw(st.lists(token, max_size=40)), skip)


@HYPOTHESIS
@given(
    text=st.text(alphabet=st.characters(codec="utf-8"), max_size=60)
    | st.lists(
        st.sampled_from(
            ["😀", "日本語", " ", "a", "é", "🇫🇷", "\n", "𝄞", "👨‍👩‍👧", "<s>", "</s>", "<|im_end|>"]
        ),
        max_size=10,
    ).map("".join),
    skip=st.booleans(),
)
def test_encoded_text_streams_back(tokenizer, text, skip):
    ids = tokenizer.encode(text)
    check_stream(tokenizer, ids, skip)


@pytest.mark.parametrize("text", ["𝄞 日本語 🧠 👨‍👩‍👧‍👦", "ꙮ漢字ꙮ"])
def test_characters_split_across_byte_tokens_arrive_whole(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    deltas = stream(tokenizer, ids)
    assert "".join(deltas) == tokenizer.decode(ids)
    assert all("\ufffd" not in d for d in deltas)
    assert len(ids) > len([d for d in deltas if d])  # some characters took several tokens


def test_a_bad_byte_does_not_undo_the_characters_before_it(gguf_llama):
    # tokenizers' ByteFallback would turn the whole run into U+FFFDs once 0xE5 is followed by a
    # non-byte token; our decode keeps "你", so "你" can be sent as soon as it is complete.
    ids = [gguf_llama.token_to_id(f"<0x{b:02X}>") for b in (0xE4, 0xBD, 0xA0, 0xE5)]
    ids.append(gguf_llama.encode("a", add_special_tokens=False)[-1])
    deltas = stream(gguf_llama, ids)
    assert deltas[2] == "你"
    assert "".join(deltas) == gguf_llama.decode(ids) == "你\ufffd a"


def test_incomplete_character_is_flushed_at_the_end(smollm):
    lead = smollm.token_to_id("ð")  # byte 0xF0: the first of a four-byte character
    detok = IncrementalDetokenizer(smollm)
    assert detok.push(smollm.encode("ok", False)[0]) == "ok"
    assert detok.push(lead) == ""
    assert detok.flush() == "\ufffd" == smollm.decode([lead])


def test_prompt_ids_give_the_continuation_of_the_prompt(spm_folder):
    tokenizer = load_tokenizer(spm_folder)
    prompt = tokenizer.encode("Say hi:")
    generated = tokenizer.encode("Hello world", add_special_tokens=False)
    assert "".join(stream(tokenizer, generated)) == "Hello world" == tokenizer.decode(generated)
    continued = "".join(stream(tokenizer, generated, prompt=prompt))
    assert continued == " Hello world"
    whole = tokenizer.decode(prompt + generated)
    assert continued == whole[len(tokenizer.decode(prompt)) :]


def test_prompt_ids_change_nothing_for_byte_level(smollm):
    prompt = smollm.encode("<|im_start|>assistant\n")
    generated = smollm.encode("Hi 😀 there", add_special_tokens=False)
    assert "".join(stream(smollm, generated, prompt=prompt)) == smollm.decode(generated)


class _CountingTokenizer(Tokenizer):
    """Delegates to another tokenizer and records the length of every decoded id list."""

    def __init__(self, inner: Tokenizer) -> None:
        self.inner, self.lengths = inner, []
        super().__init__(
            name=inner.name,
            vocab_size=inner.vocab_size,
            bos_token=inner.bos_token,
            bos_token_id=inner.bos_token_id,
            eos_token=inner.eos_token,
            eos_token_ids=inner.eos_token_ids,
            pad_token_id=inner.pad_token_id,
            add_bos=inner.add_bos,
            special_ids=inner.special_ids,
        )

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.inner.encode(text, add_special_tokens)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        self.lengths.append(len(ids))
        return self.inner.decode(ids, skip_special_tokens)

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str | None]:
        return self.inner.convert_ids_to_tokens(ids)

    def token_to_id(self, token: str) -> int | None:
        return self.inner.token_to_id(token)


def test_each_push_decodes_a_short_window(tokenizer):
    counting = _CountingTokenizer(tokenizer)
    text = Path(__file__).read_text(encoding="utf-8") * 2  # a few thousand tokens
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) > 2000
    detok = IncrementalDetokenizer(counting)
    out = "".join(detok.push(i) for i in ids) + detok.flush()
    assert out == tokenizer.decode(ids)
    assert max(counting.lengths) <= 12
    assert len(counting.lengths) <= 2 * len(ids) + 2
