"""Strings to token ids for the sampler: bad words and DRY's sequence breakers.

- `bad_word_ids` (vLLM's rule): each word is encoded as written (leading spaces stripped) and
  with one leading space; the spaced variant is kept when it tokenizes to as many tokens with
  a different first token. A one-token result is banned outright; longer ones are banned at
  their last token, after the rest.
- `breaker_ids` (llama.cpp's single-token breakers): every token whose text contains one of
  the breaker strings (each cut to 40 characters). llama.cpp also builds multi-token breakers
  from tokens that end with a breaker's first characters; with the default one-character
  breakers there are none, and they are not modelled here.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence

from metrale_jax.errors import InvalidParameterError

MAX_BREAKER_CHARS = 40


class _VocabTexts:
    """One tokenizer's token texts and the breaker sets computed from them."""

    def __init__(self, tokenizer):
        self.texts = tuple(tokenizer.decode([i]) for i in range(tokenizer.vocab_size))
        self.breakers: dict[tuple[str, ...], tuple[int, ...]] = {}


_lock = threading.Lock()
_cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _vocab(tokenizer) -> _VocabTexts:
    with _lock:
        entry = _cache.get(tokenizer)
        if entry is None:
            entry = _cache[tokenizer] = _VocabTexts(tokenizer)
        return entry


def token_texts(tokenizer) -> tuple[str, ...]:
    """Every token's text (special tokens rendered), computed once per tokenizer."""
    return _vocab(tokenizer).texts


def breaker_ids(tokenizer, breakers: Sequence[str]) -> tuple[int, ...]:
    """The token ids that cut DRY's matches for these breaker strings (cached)."""
    key = tuple(b[:MAX_BREAKER_CHARS] for b in breakers if b)
    if not key:
        return ()
    vocab = _vocab(tokenizer)
    with _lock:
        found = vocab.breakers.get(key)
    if found is None:
        found = tuple(i for i, t in enumerate(vocab.texts) if any(b in t for b in key))
        with _lock:
            vocab.breakers[key] = found
    return found


def bad_word_ids(tokenizer, words: Sequence[str]
                 ) -> tuple[tuple[int, ...], tuple[tuple[int, ...], ...]]:
    """(ids banned outright, multi-token sequences) for `bad_words`."""
    single: list[int] = []
    multi: list[tuple[int, ...]] = []
    for word in words:
        variants: list[list[int]] = []
        for prefix in ("", " "):
            ids = tokenizer.encode(prefix + word.lstrip(), add_special_tokens=False)
            if not ids:
                continue
            if prefix and variants and (ids[0] == variants[-1][0]
                                        or len(ids) != len(variants[-1])):
                continue
            variants.append(ids)
        if not variants:
            raise InvalidParameterError(f"bad word {word!r} encodes to no tokens",
                                        param="bad_words")
        for ids in variants:
            if len(ids) == 1:
                single.append(ids[0])
            else:
                multi.append(tuple(ids))
    return tuple(dict.fromkeys(single)), tuple(dict.fromkeys(multi))
