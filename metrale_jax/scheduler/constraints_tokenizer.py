"""Our `Tokenizer` as llguidance sees it: an `LLTokenizer`, built once per model.

llguidance computes token masks from the bytes of every token. Two ways to give it those:
- `HFTokenizer` (Hugging Face folders and vocabularies rebuilt from GGUF metadata): the wrapped
  `tokenizers.Tokenizer` serialized to JSON, which llguidance's Rust side reads itself (what
  `llguidance.hf.from_tokenizer` does, without importing transformers).
- any other `Tokenizer` (SentencePiece), or an `HFTokenizer` whose JSON llguidance cannot read:
  a `llguidance.TokenizerWrapper` over the bytes of each token (`token_bytes`) and our encoder.

Either way the LLTokenizer covers `vocab_size` ids, the engine's vocabulary (the embedding may
be padded past the tokenizer's ids): the ids past the tokenizer's are tokens that no grammar
allows, so their mask bits are always 0. The eos ids are all of `Tokenizer.eos_token_ids`:
llguidance allows them exactly when the grammar accepts.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Sequence

import llguidance

from metrale_jax.text.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

SPECIAL_MARKER = b"\xff"
"""llguidance's prefix for special tokens (0xFF is never valid UTF-8): text that spells a
special token does not match it, only the grammar's `<|...|>` special-token syntax does."""

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_SPM_SPACE = "\u2581"


def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: the character that stands for each byte."""
    from metrale_jax.text.gguf_tokenizer import bytes_to_unicode

    return {char: byte for byte, char in bytes_to_unicode().items()}


def _is_byte_level(backend_json: dict) -> bool:
    decoder = backend_json.get("decoder") or {}
    parts = decoder.get("decoders", [decoder]) if decoder.get("type") == "Sequence" else [decoder]
    return any(part.get("type") == "ByteLevel" for part in parts if isinstance(part, dict))


def token_bytes(tokenizer: Tokenizer) -> list[bytes]:
    """The bytes of each id `0 .. tokenizer.vocab_size - 1`, as llguidance wants them.

    Special tokens, and all added tokens of an `HFTokenizer` (as llguidance's own reading of a
    tokenizer.json has it), are `SPECIAL_MARKER` + their text; byte tokens (`<0x0A>`) are their
    byte; pieces of a byte-level BPE (GPT-2's alphabet) map back to bytes; otherwise
    SentencePiece's `▁` is a space. An id with no vocabulary entry is `b""` (never allowed).
    """
    added: set[int] = set()
    byte_level: dict[str, int] | None = None
    backend = getattr(tokenizer, "backend", None)
    if backend is not None and hasattr(backend, "to_str"):
        if _is_byte_level(json.loads(backend.to_str())):
            byte_level = _byte_level_decoder()
        added = set(backend.get_added_tokens_decoder())
    pieces = tokenizer.convert_ids_to_tokens(range(tokenizer.vocab_size))
    out: list[bytes] = []
    for token_id, piece in enumerate(pieces):
        if piece is None:
            out.append(b"")
        elif tokenizer.is_special(token_id) or token_id in added:
            out.append(SPECIAL_MARKER + piece.encode("utf-8"))
        elif (match := _BYTE_PIECE.fullmatch(piece)) is not None:
            out.append(bytes([int(match.group(1), 16)]))
        elif byte_level is not None:
            out.append(
                b"".join(
                    bytes([byte_level[c]]) if c in byte_level else c.encode("utf-8")
                    for c in piece
                )
            )
        else:
            out.append(piece.replace(_SPM_SPACE, " ").encode("utf-8"))
    return out


class _BytesTokenizer:
    """What `llguidance.TokenizerWrapper` reads: token bytes, eos/bos and an encoder.

    llguidance needs the encoder to be exact: the bytes of the ids it returns are the text's.
    SentencePiece adds a space before a text's first piece (`"{"` -> `"▁{"`); where our
    `encode` does not round-trip, a greedy longest match over the token bytes is used instead
    (llguidance only needs a valid tokenization there, not the canonical one). The encoder
    takes `str` only (it raises TypeError on bytes), so the wrapper hands it text.
    """

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        self._tokenizer = tokenizer
        tokens = token_bytes(tokenizer)
        self.tokens = tokens + [b""] * (vocab_size - len(tokens))
        self.eos_token_id = tokenizer.eos_token_id
        self.bos_token_id = tokenizer.bos_token_id
        self.special_token_ids = sorted(tokenizer.special_ids)
        # llguidance allows one id per byte string: the one the encoder gives. Where a byte
        # token (`<0x7B>`) and a piece (`{`) spell the same bytes, the piece wins.
        pieces = tokenizer.convert_ids_to_tokens(range(len(tokens)))
        is_byte = [p is not None and _BYTE_PIECE.fullmatch(p) is not None for p in pieces]
        self._ids: dict[bytes, int] = {}
        for token_id in sorted(range(len(tokens)), key=lambda i: is_byte[i]):
            data = tokens[token_id]
            if data and not data.startswith(SPECIAL_MARKER):
                self._ids.setdefault(data, token_id)
        self._longest = max(map(len, self._ids), default=1)

    def __call__(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise TypeError("encodes str only")
        ids = self._tokenizer.encode(text, add_special_tokens=False)
        data = text.encode("utf-8")
        if b"".join(self.tokens[i] for i in ids) == data:
            return ids
        return self._greedy(data)

    def _greedy(self, data: bytes) -> list[int]:
        """Longest-match ids of `data`; a byte no token spells is skipped."""
        ids, start = [], 0
        while start < len(data):
            for end in range(min(len(data), start + self._longest), start, -1):
                token_id = self._ids.get(data[start:end])
                if token_id is not None:
                    ids.append(token_id)
                    start = end
                    break
            else:
                start += 1
        return ids


def build_ll_tokenizer(
    tokenizer: Tokenizer, vocab_size: int | None = None, *, from_bytes: bool = False
) -> llguidance.LLTokenizer:
    """The `LLTokenizer` of `tokenizer` over `vocab_size` ids (default: the tokenizer's).

    Args:
        tokenizer: any backend of `metrale_jax.text`.
        vocab_size: the engine's vocabulary `V` (the model's logits width), at least the
            tokenizer's; ids past the tokenizer's are never allowed.
        from_bytes: build from `token_bytes` even when the tokenizer has a `tokenizers` backend
            (for tests that compare the two paths).

    Raises:
        ValueError: `vocab_size` is smaller than the tokenizer's vocabulary.
    """
    V = tokenizer.vocab_size if vocab_size is None else int(vocab_size)
    if tokenizer.vocab_size > V:
        raise ValueError(
            f"the engine's vocabulary ({V}) is smaller than the tokenizer's "
            f"({tokenizer.vocab_size}): token ids would fall outside the logits"
        )
    eos: Sequence[int] | None = list(tokenizer.eos_token_ids) or None
    backend = getattr(tokenizer, "backend", None)
    if not from_bytes and backend is not None and hasattr(backend, "to_str"):
        try:
            ll = llguidance.LLTokenizer(backend.to_str(), n_vocab=V, eos_token=eos)
        except Exception as err:  # llguidance raises ValueError/RuntimeError on unknown JSON
            logger.warning(
                "llguidance cannot read the tokenizer.json of %s (%s); using token bytes",
                tokenizer.name,
                err,
            )
        else:
            logger.info("llguidance tokenizer from tokenizer.json: %d ids", ll.vocab_size)
            return ll
    wrapper = llguidance.TokenizerWrapper(_BytesTokenizer(tokenizer, V))
    ll = llguidance.LLTokenizer(wrapper, n_vocab=V, eos_token=eos)
    logger.info("llguidance tokenizer from token bytes: %d ids", ll.vocab_size)
    return ll
