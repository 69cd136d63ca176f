"""Building a tokenizer from the vocabulary stored in GGUF metadata.

A GGUF file carries no `tokenizer.json`; llama.cpp's converter stores the vocabulary under
`tokenizer.ggml.*` keys. Two kinds are supported, rebuilt as `tokenizers` pipelines that encode
the way llama.cpp does:

- `"gpt2"`: byte-level BPE (SmolLM, Llama 3, Qwen 2, ...): the tokens are written in GPT-2's
  byte alphabet, the merges are stored, and `tokenizer.ggml.pre` names the split regexes.
- `"llama"`: a SentencePiece vocabulary (Llama 2, Mistral, ...) with one score per token and
  `<0xNN>` byte tokens; it becomes a byte-fallback BPE whose merges are ranked by score, as
  transformers' GGUF loader does. A space is prefixed to the text and, as llama.cpp does, to
  the text after each special token.

Token types (`tokenizer.ggml.token_type`): 1 normal, 2 unknown, 3 control, 4 user-defined,
5 unused, 6 byte. Control tokens become special added tokens; user-defined ones plain added
tokens: both are matched whole in the text.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from functools import cache
from pathlib import Path
from typing import Any

from tokenizers import Regex, decoders, normalizers, pre_tokenizers
from tokenizers import Tokenizer as RustTokenizer
from tokenizers.models import BPE

from metrale_jax.errors import CheckpointError, UnsupportedModelError
from metrale_jax.text.gguf_metadata import read_gguf_metadata
from metrale_jax.text.gguf_pretokenizers import pre_tokenizer_spec
from metrale_jax.text.hf_config import AddedTokenSpec
from metrale_jax.text.hf_tokenizer import HFTokenizer

logger = logging.getLogger(__name__)

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
_PREFIX = "tokenizer.ggml."


@cache
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte alphabet: a printable character for each of the 256 byte values."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    mapping, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            mapping[byte] = chr(byte)
        else:
            mapping[byte] = chr(256 + extra)
            extra += 1
    return mapping


def _vocab(tokens: Sequence[str]) -> dict[str, int]:
    vocab: dict[str, int] = {}
    for token_id, token in enumerate(tokens):
        vocab.setdefault(token, token_id)
    if len(vocab) != len(tokens):
        logger.warning(
            "GGUF vocabulary repeats %d tokens; the later copies are never produced by encode",
            len(tokens) - len(vocab),
        )
    return vocab


def _merges(raw: Sequence[str]) -> list[tuple[str, str]]:
    merges = []
    for merge in raw:
        cut = merge.find(" ", 1)  # as llama.cpp: the first space after the first character
        if cut < 0:
            raise CheckpointError(f"GGUF merge {merge!r} has no space")
        merges.append((merge[:cut], merge[cut + 1 :]))
    return merges


def _byte_level_backend(
    meta: Mapping[str, Any], tokens: list[str], types: list[int]
) -> RustTokenizer:
    alphabet = set(bytes_to_unicode().values())
    spelling = bytes_to_unicode()
    spelled = [
        token
        if types[i] in (CONTROL, USER_DEFINED) or set(token) <= alphabet
        else "".join(spelling[b] for b in token.encode("utf-8"))
        for i, token in enumerate(tokens)
    ]
    if _PREFIX + "merges" not in meta:
        raise CheckpointError("a GGUF byte-level BPE vocabulary needs tokenizer.ggml.merges")
    spec = pre_tokenizer_spec(meta.get(_PREFIX + "pre"))
    model = BPE(
        vocab=_vocab(spelled),
        merges=_merges(meta[_PREFIX + "merges"]),
        dropout=None,
        continuing_subword_prefix="",
        end_of_word_suffix="",
        fuse_unk=False,
        ignore_merges=spec.ignore_merges,
    )
    backend = RustTokenizer(model)
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(regex), behavior="isolated") for regex in spec.regexes]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    backend.decoder = decoders.ByteLevel()
    return backend


def score_merges(
    tokens: Sequence[str], scores: Sequence[float], types: Sequence[int]
) -> list[tuple[str, str]]:
    """BPE merges implied by a SentencePiece vocabulary: every split of a normal token into two
    normal tokens, best-scoring merged token first (SentencePiece's BPE merges by score)."""
    normal = {t: i for i, t in enumerate(tokens) if types[i] == NORMAL}
    ranked = []
    for token, token_id in normal.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in normal and right in normal:
                ranked.append((-scores[token_id], token_id, left, right))
    ranked.sort()
    return [(left, right) for _, _, left, right in ranked]


def _sentencepiece_backend(
    meta: Mapping[str, Any], tokens: list[str], types: list[int], add_space_prefix: bool
) -> RustTokenizer:
    if meta.get(_PREFIX + "merges"):
        merges = _merges(meta[_PREFIX + "merges"])
    else:
        scores = meta.get(_PREFIX + "scores")
        if scores is None or len(scores) != len(tokens):
            logger.warning("GGUF SentencePiece vocabulary has no scores; ranking merges by id")
            scores = [-float(i) for i in range(len(tokens))]
        merges = score_merges(tokens, scores, types)
    unk_id = meta.get(_PREFIX + "unknown_token_id")
    unk = tokens[unk_id] if isinstance(unk_id, int) and 0 <= unk_id < len(tokens) else None
    backend = RustTokenizer(
        BPE(
            vocab=_vocab(tokens),
            merges=merges,
            unk_token=unk,
            fuse_unk=True,
            byte_fallback=True,
            dropout=None,
        )
    )
    steps = [normalizers.Prepend("▁")] if add_space_prefix else []
    backend.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", "▁")])
    chain = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        chain.append(decoders.Strip(" ", 1, 0))
    backend.decoder = decoders.Sequence(chain)
    return backend


def _token_at(tokens: Sequence[str], meta: Mapping[str, Any], key: str) -> str | None:
    token_id = meta.get(_PREFIX + key)
    if isinstance(token_id, int) and 0 <= token_id < len(tokens):
        return tokens[token_id]
    return None


def tokenizer_from_gguf_metadata(
    meta: Mapping[str, Any], name: str = "GGUF metadata"
) -> HFTokenizer:
    """A tokenizer for the vocabulary in GGUF metadata (`read_gguf_metadata`'s dict).

    Raises:
        CheckpointError: the vocabulary keys are missing or malformed.
        UnsupportedModelError: `tokenizer.ggml.model` is neither "gpt2" nor "llama".
    """
    kind = meta.get(_PREFIX + "model")
    tokens = meta.get(_PREFIX + "tokens")
    if not isinstance(tokens, list) or not tokens:
        raise CheckpointError(f"{name}: no tokenizer.ggml.tokens in the GGUF metadata")
    types = list(meta.get(_PREFIX + "token_type") or [NORMAL] * len(tokens))
    if len(types) != len(tokens):
        raise CheckpointError(f"{name}: {len(types)} token types for {len(tokens)} tokens")
    pre = meta.get(_PREFIX + "pre")
    if kind == "gpt2":
        backend = _byte_level_backend(meta, tokens, types)
        default_bos = pre_tokenizer_spec(pre).add_bos
    elif kind == "llama":
        backend = _sentencepiece_backend(
            meta, tokens, types, bool(meta.get(_PREFIX + "add_space_prefix", True))
        )
        default_bos = True
    else:
        raise UnsupportedModelError(
            f"{name}: GGUF tokenizer model {kind!r} is not supported (only 'gpt2' and 'llama')"
        )
    added = {
        i: AddedTokenSpec(tokens[i], special=types[i] == CONTROL)
        for i in range(len(tokens))
        if types[i] in (CONTROL, USER_DEFINED)
    }
    extra_eos = [
        meta[_PREFIX + key]
        for key in ("eot_token_id", "eom_token_id")
        if isinstance(meta.get(_PREFIX + key), int)
    ]
    logger.info(
        "GGUF tokenizer %s: %s, pre=%r, %d tokens, %d added",
        name,
        kind,
        pre,
        len(tokens),
        len(added),
    )
    return HFTokenizer(
        backend,
        name=name,
        bos_token=_token_at(tokens, meta, "bos_token_id"),
        eos_token=_token_at(tokens, meta, "eos_token_id"),
        unk_token=_token_at(tokens, meta, "unknown_token_id"),
        pad_token=_token_at(tokens, meta, "padding_token_id"),
        added_tokens=added,
        add_bos_token=bool(meta.get(_PREFIX + "add_bos_token", default_bos)),
        add_eos_token=bool(meta.get(_PREFIX + "add_eos_token", False)),
        chat_template=meta.get("tokenizer.chat_template"),
        extra_eos_ids=extra_eos,
    )


def load_gguf_tokenizer(path: Path | str) -> HFTokenizer:
    """The tokenizer stored in the GGUF file at `path` (see `tokenizer_from_gguf_metadata`)."""
    return tokenizer_from_gguf_metadata(read_gguf_metadata(path), name=str(path))
