"""The one tokenizer interface that the rest of Metrale-JAX sees.

Two classes implement it: `HFTokenizer` (a `tokenizer.json` from a Hugging Face folder, also
used for vocabularies rebuilt from GGUF metadata) and `SentencePieceTokenizer` (a
`tokenizer.model`); `text.loader.load_tokenizer` picks one. Everything above `text/` (the
scheduler, the server) only uses `Tokenizer`.

Ids are plain Python ints; a sequence of ids is any `Sequence[int]`.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence

from metrale_jax.errors import InvalidParameterError

logger = logging.getLogger(__name__)


def lone_surrogate(text: str) -> int | None:
    """The index of the first lone UTF-16 surrogate (U+D800-U+DFFF) in `text`, or None.

    A JSON body may escape one (`"\\ud800"`) and Python keeps it in the str, but it is no
    Unicode character: no tokenizer can encode it (the Rust one raises TypeError)."""
    if text.isascii():
        return None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:  # only surrogates fail to encode
        return e.start
    return None


class InvalidTextError(InvalidParameterError, ValueError):
    """Text that is not valid Unicode (a lone surrogate): a 400 in the server, a ValueError
    (as vLLM's and Hugging Face's tokenizers raise for bad input) in the Python API."""


def check_unicode(text: str, param: str | None = None) -> None:
    """Raises `InvalidTextError` (HTTP 400 naming `param`; a ValueError) when `text` holds a
    lone surrogate, which is not valid Unicode text."""
    at = lone_surrogate(text)
    if at is not None:
        where = f"`{param}`" if param else "the text"
        raise InvalidTextError(
            f"{where} holds a lone UTF-16 surrogate (U+{ord(text[at]):04X} at character {at}), "
            f"which is not valid Unicode text", param=param)


class Tokenizer(ABC):
    """Text <-> token ids, with the model's special tokens.

    Attributes (read-only properties):
        name: where the tokenizer came from (a folder or file), for messages.
        vocab_size: the number of ids, added tokens included (max id + 1).
        bos_token / bos_token_id: the beginning-of-sequence token, or None.
        eos_token: the model's main end-of-sequence token, or None.
        eos_token_ids: every id that ends generation (the eos token first, then others the model
            files name, e.g. `generation_config.json`'s list or GGUF's end-of-turn token).
        pad_token_id: the padding id, or None.
        add_bos: whether `encode(text, add_special_tokens=True)` prepends `bos_token_id`, as the
            model's files say.
        special_ids: the ids that `decode(..., skip_special_tokens=True)` drops.
        chat_template: the Jinja chat template the model files carry, or None.

    Decoding is local, which the incremental detokenizer relies on: `decode(ids[:k])` is a
    prefix of `decode(ids)`, except for a trailing incomplete UTF-8 character (U+FFFDs until
    its bytes complete); only the start of a text is decoded specially (SentencePiece-style
    tokenizers drop its leading space).
    """

    def __init__(
        self,
        *,
        name: str,
        vocab_size: int,
        bos_token: str | None,
        bos_token_id: int | None,
        eos_token: str | None,
        eos_token_ids: Iterable[int],
        pad_token_id: int | None,
        add_bos: bool,
        special_ids: Iterable[int],
        chat_template: str | None = None,
    ) -> None:
        self._name = name
        self._vocab_size = int(vocab_size)
        self._bos_token = bos_token
        self._bos_token_id = bos_token_id
        self._eos_token = eos_token
        self._eos_token_ids = tuple(dict.fromkeys(int(i) for i in eos_token_ids))
        self._pad_token_id = pad_token_id
        self._add_bos = bool(add_bos)
        self._special_ids = frozenset(int(i) for i in special_ids)
        self._chat_template = chat_template or None
        logger.debug(
            "tokenizer %s: %d ids, bos=%r, eos=%r (ids %s), add_bos=%s, %d special ids",
            name,
            self._vocab_size,
            bos_token,
            eos_token,
            self._eos_token_ids,
            self._add_bos,
            len(self._special_ids),
        )

    # ---- metadata -------------------------------------------------------------------------

    @property
    def name(self) -> str:
        """Where this tokenizer was loaded from (a folder or a file)."""
        return self._name

    @property
    def vocab_size(self) -> int:
        """The number of token ids, added tokens included."""
        return self._vocab_size

    @property
    def bos_token(self) -> str | None:
        """The beginning-of-sequence token's text, or None."""
        return self._bos_token

    @property
    def bos_token_id(self) -> int | None:
        """The beginning-of-sequence id, or None."""
        return self._bos_token_id

    @property
    def eos_token(self) -> str | None:
        """The main end-of-sequence token's text, or None."""
        return self._eos_token

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """All ids that end generation, the main eos id first."""
        return self._eos_token_ids

    @property
    def eos_token_id(self) -> int | None:
        """The main end-of-sequence id (the first of `eos_token_ids`), or None."""
        return self._eos_token_ids[0] if self._eos_token_ids else None

    @property
    def pad_token_id(self) -> int | None:
        """The padding id, or None."""
        return self._pad_token_id

    @property
    def add_bos(self) -> bool:
        """Whether `encode(text, add_special_tokens=True)` prepends the bos id."""
        return self._add_bos

    @property
    def special_ids(self) -> frozenset[int]:
        """The ids that `decode(ids, skip_special_tokens=True)` leaves out."""
        return self._special_ids

    @property
    def chat_template(self) -> str | None:
        """The Jinja chat template from the model's files, or None."""
        return self._chat_template

    def is_special(self, token_id: int) -> bool:
        """True when `token_id` is one of `special_ids`."""
        return token_id in self._special_ids

    def __len__(self) -> int:
        return self._vocab_size

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._name!r}, vocab_size={self._vocab_size})"

    # ---- the conversions each backend implements -------------------------------------------

    @abstractmethod
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`.

        Special and added tokens written in the text (e.g. `<|im_start|>`) become their single
        ids. With `add_special_tokens`, the tokens the model's files ask for (bos when `add_bos`,
        eos where configured) are added around the text.
        """

    @abstractmethod
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """The text of `ids`; with `skip_special_tokens`, the ids in `special_ids` are left out.

        Bytes that do not form valid UTF-8 come out as U+FFFD.
        """

    @abstractmethod
    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str | None]:
        """The vocabulary entry (token string) of each id; None for an id outside the vocabulary."""

    @abstractmethod
    def token_to_id(self, token: str) -> int | None:
        """The id of the vocabulary entry `token`, or None if there is no such entry."""
