"""The Hugging Face `tokenizers` backend: a `tokenizer.json`, or a vocabulary rebuilt from GGUF.

`HFTokenizer` wraps a `tokenizers.Tokenizer` (the Rust library transformers' fast tokenizers
use) and applies what `tokenizer_config.json` adds on top, as
`transformers.AutoTokenizer.from_pretrained(folder)` does:
- named special tokens (bos/eos/unk/pad, extra special tokens) missing from the added
  vocabulary are added as special tokens, and `added_tokens_decoder` entries are added;
- what `encode(add_special_tokens=True)` adds is the `tokenizer.json` post-processor's choice
  (transformers 5 ignores `add_bos_token` in the config beside a `tokenizer.json`); vocabularies
  rebuilt from GGUF pass their `add_bos_token` flag explicitly;
- truncation and padding are switched off (a server never cuts a prompt silently).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from tokenizers import AddedToken, processors
from tokenizers import Tokenizer as RustTokenizer

from metrale_jax.errors import CheckpointError
from metrale_jax.text.hf_config import AddedTokenSpec, read_tokenizer_files
from metrale_jax.text.tokenizer import Tokenizer, check_unicode

logger = logging.getLogger(__name__)

TOKENIZER_JSON = "tokenizer.json"


def byte_token(value: int) -> str:
    """The byte-fallback token name of one byte: `byte_token(10) == "<0x0A>"`."""
    return f"<0x{value:02X}>"


def _bad_offsets(data: bytes) -> list[int]:
    """Offsets of the bytes of `data` that are not part of a complete UTF-8 character."""
    try:
        data.decode("utf-8")
        return []
    except UnicodeDecodeError:
        pass
    bad, offset = [], 0
    for char in data.decode("utf-8", errors="surrogateescape"):
        if "\udc80" <= char <= "\udcff":  # surrogateescape: one lone surrogate per bad byte
            bad.append(offset)
            offset += 1
        else:
            offset += len(char.encode("utf-8"))
    return bad


def _added_token(spec: AddedTokenSpec) -> AddedToken:
    return AddedToken(
        spec.content,
        single_word=spec.single_word,
        lstrip=spec.lstrip,
        rstrip=spec.rstrip,
        normalized=spec.normalized,
        special=spec.special,
    )


class HFTokenizer(Tokenizer):
    """A `Tokenizer` backed by a `tokenizers.Tokenizer`.

    Args:
        backend: the Rust tokenizer; this object takes it over (it is modified in place).
        name: where it came from, for messages.
        bos_token, eos_token, unk_token, pad_token: the named special tokens (text), or None.
        extra_special_tokens: more tokens to treat as special (added if missing).
        added_tokens: `added_tokens_decoder` entries, id -> spec, added if missing.
        add_bos_token, add_eos_token: None keeps the backend's post-processor; a bool (either
            one set) replaces it with one that adds exactly these tokens, as transformers does.
        chat_template: the model's chat template, if any.
        extra_eos_ids: more ids that end generation (e.g. from `generation_config.json`).
    """

    def __init__(
        self,
        backend: RustTokenizer,
        *,
        name: str,
        bos_token: str | None = None,
        eos_token: str | None = None,
        unk_token: str | None = None,
        pad_token: str | None = None,
        extra_special_tokens: Iterable[str] = (),
        added_tokens: Mapping[int, AddedTokenSpec] | None = None,
        add_bos_token: bool | None = None,
        add_eos_token: bool | None = None,
        chat_template: str | None = None,
        extra_eos_ids: Iterable[int] = (),
    ) -> None:
        self._backend = backend
        backend.no_truncation()
        backend.no_padding()
        self._add_missing_tokens(
            added_tokens or {}, [bos_token, eos_token, unk_token, pad_token, *extra_special_tokens]
        )
        bos_id = backend.token_to_id(bos_token) if bos_token is not None else None
        eos_id = backend.token_to_id(eos_token) if eos_token is not None else None
        if add_bos_token is not None or add_eos_token is not None or backend.post_processor is None:
            self._set_post_processor(
                (bos_token, bos_id) if add_bos_token else None,
                (eos_token, eos_id) if add_eos_token else None,
            )
        added = backend.get_added_tokens_decoder()
        vocab = backend.get_vocab(with_added_tokens=True)
        # id -> byte value of the <0xNN> tokens, when the decoder is tokenizers' ByteFallback
        self._byte_values: dict[int, int] = {}
        if "ByteFallback" in str(backend.decoder):
            self._byte_values = {
                i: b for b in range(256) if (i := vocab.get(byte_token(b))) is not None
            }
        super().__init__(
            name=name,
            vocab_size=max(vocab.values(), default=-1) + 1,
            bos_token=bos_token if bos_id is not None else None,
            bos_token_id=bos_id,
            eos_token=eos_token if eos_id is not None else None,
            eos_token_ids=[*([eos_id] if eos_id is not None else []), *extra_eos_ids],
            pad_token_id=backend.token_to_id(pad_token) if pad_token is not None else None,
            add_bos=self._probe_adds_bos(bos_id),
            special_ids=[token_id for token_id, token in added.items() if token.special],
            chat_template=chat_template,
        )

    # ---- construction helpers -----------------------------------------------------------

    def _add_missing_tokens(
        self, added_tokens: Mapping[int, AddedTokenSpec], named: Sequence[str | None]
    ) -> None:
        backend = self._backend
        present = {token.content for token in backend.get_added_tokens_decoder().values()}
        for token_id, spec in sorted(added_tokens.items()):
            if spec.content in present:
                continue
            add = backend.add_special_tokens if spec.special else backend.add_tokens
            add([_added_token(spec)])
            present.add(spec.content)
            got = backend.token_to_id(spec.content)
            if got != token_id:
                logger.warning(
                    "%s: added token %r got id %s, but the config says %d",
                    self.__class__.__name__,
                    spec.content,
                    got,
                    token_id,
                )
        missing = [t for t in dict.fromkeys(named) if t is not None and t not in present]
        if missing:
            backend.add_special_tokens(
                [AddedToken(t, special=True, normalized=False) for t in missing]
            )

    def _set_post_processor(
        self, bos: tuple[str | None, int | None] | None, eos: tuple[str | None, int | None] | None
    ) -> None:
        bos = bos if bos is not None and bos[0] is not None and bos[1] is not None else None
        eos = eos if eos is not None and eos[0] is not None and eos[1] is not None else None
        head = f"{bos[0]}:0 " if bos else ""
        tail = f" {eos[0]}:0" if eos else ""
        pair_head = f" {bos[0]}:1" if bos else ""
        pair_tail = f" {eos[0]}:1" if eos else ""
        self._backend.post_processor = processors.TemplateProcessing(
            single=f"{head}$A:0{tail}",
            pair=f"{head}$A:0{tail}{pair_head} $B:1{pair_tail}",
            special_tokens=[t for t in (bos, eos) if t is not None],
        )

    def _probe_adds_bos(self, bos_id: int | None) -> bool:
        if bos_id is None:
            return False
        plain = self._backend.encode("a", add_special_tokens=False).ids
        full = self._backend.encode("a", add_special_tokens=True).ids
        return len(full) > len(plain) and full[0] == bos_id

    # ---- Tokenizer ------------------------------------------------------------------------

    @property
    def backend(self) -> RustTokenizer:
        """The wrapped `tokenizers.Tokenizer` (do not modify it)."""
        return self._backend

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; see `Tokenizer.encode`."""
        check_unicode(text)
        return self._backend.encode(text, add_special_tokens=bool(add_special_tokens)).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """The text of `ids`; see `Tokenizer.decode`.

        Byte-fallback tokens decode like SentencePiece: one U+FFFD per byte that is not part of
        a complete UTF-8 character. (tokenizers' `ByteFallback` instead turns a whole run of
        byte tokens into U+FFFDs when any byte of it is bad, so a later bad byte would change
        text decoded earlier; valid UTF-8 decodes the same either way.)
        """
        ids = [int(i) for i in ids]
        skip_special_tokens = bool(skip_special_tokens)
        if self._byte_values and any(i in self._byte_values for i in ids):
            text = self._decode_bad_bytes(ids, skip_special_tokens)
            if text is not None:
                return text
        return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def _decode_bad_bytes(self, ids: list[int], skip: bool) -> str | None:
        """Decode with each bad byte shown as one U+FFFD; None if every byte run is valid.

        Each bad byte token is replaced by the token of byte 0x00, then of 0x01 (both complete
        one-byte characters, so the runs become valid); where the two decodings differ, the
        text had a bad byte.
        """
        values = self._byte_values
        kept = [i for i in ids if not (skip and i in self.special_ids)]
        bad: list[int] = []
        run: list[int] = []
        for index, token_id in enumerate([*kept, -1]):
            if token_id in values:
                run.append(index)
                continue
            if run:
                offsets = _bad_offsets(bytes(values[kept[j]] for j in run))
                bad += [run[offset] for offset in offsets]
                run = []
        inverse = {b: i for i, b in values.items()}
        if not bad or 0 not in inverse or 1 not in inverse:
            return None
        zero, one = list(kept), list(kept)
        for index in bad:
            zero[index], one[index] = inverse[0], inverse[1]
        first = self._backend.decode(zero, skip_special_tokens=skip)
        second = self._backend.decode(one, skip_special_tokens=skip)
        return "".join(a if a == b else "\ufffd" for a, b in zip(first, second, strict=True))

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str | None]:
        """The token string of each id (None outside the vocabulary)."""
        return [self._backend.id_to_token(int(i)) for i in ids]

    def token_to_id(self, token: str) -> int | None:
        """The id of the token string `token`, or None."""
        return self._backend.token_to_id(token)


def load_hf_tokenizer(folder: Path) -> HFTokenizer:
    """Load `folder/tokenizer.json` with the side files transformers reads beside it.

    Raises:
        CheckpointError: the file is missing or cannot be parsed.
    """
    folder = Path(folder)
    path = folder / TOKENIZER_JSON
    if not path.is_file():
        raise CheckpointError(f"{path} does not exist")
    try:
        backend = RustTokenizer.from_file(str(path))
    except Exception as err:  # the Rust library raises a bare Exception on a bad file
        raise CheckpointError(f"cannot load {path}: {err}") from err
    files = read_tokenizer_files(folder)
    logger.info("loaded tokenizer %s", path)
    return HFTokenizer(
        backend,
        name=str(folder),
        bos_token=files.bos_token,
        eos_token=files.eos_token,
        unk_token=files.unk_token,
        pad_token=files.pad_token,
        extra_special_tokens=files.extra_special_tokens,
        added_tokens=files.added_tokens,
        # As transformers 5 does, tokenizer.json's post-processor decides what encode adds:
        # add_bos_token/add_eos_token in tokenizer_config.json are ignored beside it.
        chat_template=files.chat_template,
        extra_eos_ids=files.generation_eos_ids,
    )
