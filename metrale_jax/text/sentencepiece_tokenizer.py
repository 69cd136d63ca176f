"""The SentencePiece backend: a `tokenizer.model` file (Llama 2, Mistral, Gemma, T5-style).

Text between special tokens is encoded by `sentencepiece` itself, so the model's own algorithm
(BPE or unigram) and normalizer apply exactly. Around it, this class does what transformers'
`LlamaTokenizer` does:
- special and added tokens written in the text (`<s>`, `</s>`, `added_tokens_decoder`) are
  matched whole, longest first;
- the space SentencePiece prefixes to the text (its "dummy prefix") is given to the first
  piece of text only, not to text after a special token, unless `tokenizer_config.json` says
  `"legacy": true`;
- `encode(add_special_tokens=True)` prepends bos (`add_bos_token`, true by default, as for
  Llama) and appends eos if `add_eos_token`;
- `decode` writes special tokens as their text, turns `▁` into spaces and `<0xNN>` runs into
  UTF-8 (one U+FFFD per byte that does not form a character, as SentencePiece does), and drops
  the one leading space of the dummy prefix.
"""

from __future__ import annotations

import codecs
import logging
import re
from collections.abc import Sequence
from pathlib import Path

import sentencepiece

from metrale_jax.errors import CheckpointError
from metrale_jax.text.hf_config import AddedTokenSpec, TokenizerFiles, read_tokenizer_files
from metrale_jax.text.spm_proto import normalizer_flags, without_dummy_prefix
from metrale_jax.text.tokenizer import Tokenizer, check_unicode

logger = logging.getLogger(__name__)

TOKENIZER_MODEL = "tokenizer.model"
_REPLACE_PER_BYTE = "metrale-replace-per-byte"


def _replace_per_byte(err: UnicodeError) -> tuple[str, int]:
    assert isinstance(err, UnicodeDecodeError)
    return "\ufffd" * (err.end - err.start), err.end


codecs.register_error(_REPLACE_PER_BYTE, _replace_per_byte)


def _load(proto: bytes, name: str) -> sentencepiece.SentencePieceProcessor:
    try:
        return sentencepiece.SentencePieceProcessor(model_proto=proto)
    except Exception as err:  # sentencepiece raises RuntimeError or OSError on a bad model
        raise CheckpointError(f"{name} is not a SentencePiece model: {err}") from err


class SentencePieceTokenizer(Tokenizer):
    """A `Tokenizer` on a SentencePiece model.

    Args:
        proto: the serialized model (the bytes of `tokenizer.model`).
        name: where it came from, for messages.
        files: what `tokenizer_config.json` and friends say (None: the model's own defaults).
    """

    def __init__(self, proto: bytes, *, name: str, files: TokenizerFiles | None = None) -> None:
        files = files or TokenizerFiles(folder=Path(name))
        sp = _load(proto, name)
        flags = normalizer_flags(proto)
        bare = _load(without_dummy_prefix(proto), name) if flags.add_dummy_prefix else sp
        prefix = flags.add_dummy_prefix and files.add_prefix_space is not False
        self._sp_first = sp if prefix else bare
        self._sp_rest = self._sp_first if files.legacy else bare
        self._strip_prefix = prefix
        self._pieces = sp.get_piece_size()
        self._sp = sp

        def piece(index: int) -> str | None:
            return sp.id_to_piece(index) if 0 <= index < self._pieces else None

        bos = files.bos_token or piece(sp.bos_id())
        eos = files.eos_token or piece(sp.eos_id())
        unk = files.unk_token or piece(sp.unk_id())
        pad = files.pad_token or piece(sp.pad_id())
        self._added: dict[str, int] = {}
        self._specs: dict[int, AddedTokenSpec] = {}
        for token_id, spec in sorted(files.added_tokens.items()):
            self._add(spec, token_id)
        for token in (bos, eos, unk, pad, *files.extra_special_tokens):
            if token is not None and token not in self._added:
                self._add(AddedTokenSpec(token, special=True), self._piece_id(token))
        self._split = self._split_regex()
        bos_id = self.token_to_id(bos) if bos is not None else None
        eos_id = self.token_to_id(eos) if eos is not None else None
        add_bos = files.add_bos_token is not False and bos_id is not None
        self._prepend = [bos_id] if add_bos and bos_id is not None else []
        self._append = [eos_id] if files.add_eos_token and eos_id is not None else []
        super().__init__(
            name=name,
            vocab_size=max(self._pieces, max(self._specs, default=-1) + 1),
            bos_token=bos if bos_id is not None else None,
            bos_token_id=bos_id,
            eos_token=eos if eos_id is not None else None,
            eos_token_ids=[*([eos_id] if eos_id is not None else []), *files.generation_eos_ids],
            pad_token_id=self.token_to_id(pad) if pad is not None else None,
            add_bos=bool(self._prepend),
            special_ids=[i for i, spec in self._specs.items() if spec.special],
            chat_template=files.chat_template,
        )

    # ---- construction helpers -----------------------------------------------------------

    def _piece_id(self, token: str) -> int | None:
        index = self._sp.piece_to_id(token)
        if index == self._sp.unk_id() and token != self._sp.id_to_piece(index):
            return None
        return index

    def _add(self, spec: AddedTokenSpec, token_id: int | None) -> None:
        if token_id is None:  # a token in neither the model nor the config: a new id, as HF does
            token_id = max(self._pieces, max(self._specs, default=-1) + 1)
            logger.info(
                "%s: special token %r is not in the vocabulary; it gets id %d",
                self.__class__.__name__,
                spec.content,
                token_id,
            )
        self._added[spec.content] = token_id
        self._specs[token_id] = spec

    def _split_regex(self) -> re.Pattern[str] | None:
        specs = sorted(self._specs.values(), key=lambda s: len(s.content), reverse=True)
        if not specs:
            return None
        parts = [
            (r"\s*" if s.lstrip else "")
            + f"({re.escape(s.content)})"
            + (r"\s*" if s.rstrip else "")
            for s in specs
            if s.content
        ]
        self._group_ids = [self._added[s.content] for s in specs if s.content]
        return re.compile("|".join(parts))

    # ---- Tokenizer ------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; see `Tokenizer.encode` and the module docstring."""
        check_unicode(text)
        ids: list[int] = list(self._prepend) if add_special_tokens else []
        pos = 0
        if self._split is not None:
            for match in self._split.finditer(text):
                if match.start() > pos:
                    sp = self._sp_first if pos == 0 else self._sp_rest
                    ids += sp.encode(text[pos : match.start()])
                ids.append(self._group_ids[(match.lastindex or 1) - 1])
                pos = match.end()
        if pos < len(text):
            ids += (self._sp_first if pos == 0 else self._sp_rest).encode(text[pos:])
        if add_special_tokens:
            ids += self._append
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """The text of `ids`; see `Tokenizer.decode` and the module docstring."""
        out: list[str] = []
        pending = bytearray()
        sp, specs = self._sp, self._specs
        for raw in ids:
            token_id = int(raw)
            if skip_special_tokens and token_id in self.special_ids:
                continue
            if token_id not in specs and 0 <= token_id < self._pieces and sp.is_byte(token_id):
                pending.append(int(sp.id_to_piece(token_id)[3:5], 16))
                continue
            if pending:
                out.append(pending.decode("utf-8", errors=_REPLACE_PER_BYTE))
                pending.clear()
            if token_id in specs:
                out.append(specs[token_id].content.replace("▁", " "))
            elif 0 <= token_id < self._pieces:
                out.append(sp.id_to_piece(token_id).replace("▁", " "))
        if pending:
            out.append(pending.decode("utf-8", errors=_REPLACE_PER_BYTE))
        text = "".join(out)
        return text[1:] if self._strip_prefix and text.startswith(" ") else text

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str | None]:
        """The piece (or added token) of each id; None outside the vocabulary."""
        out: list[str | None] = []
        for raw in ids:
            token_id = int(raw)
            if token_id in self._specs:
                out.append(self._specs[token_id].content)
            elif 0 <= token_id < self._pieces:
                out.append(self._sp.id_to_piece(token_id))
            else:
                out.append(None)
        return out

    def token_to_id(self, token: str) -> int | None:
        """The id of the piece or added token `token`, or None."""
        if token in self._added:
            return self._added[token]
        return self._piece_id(token)


def load_sentencepiece_tokenizer(folder: Path) -> SentencePieceTokenizer:
    """Load `folder/tokenizer.model` with the side files transformers reads beside it.

    Raises:
        CheckpointError: the file is missing or is not a SentencePiece model.
    """
    folder = Path(folder)
    path = folder / TOKENIZER_MODEL
    if not path.is_file():
        raise CheckpointError(f"{path} does not exist")
    tokenizer = SentencePieceTokenizer(
        path.read_bytes(), name=str(path), files=read_tokenizer_files(folder)
    )
    logger.info("loaded SentencePiece tokenizer %s", path)
    return tokenizer
