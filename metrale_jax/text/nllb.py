"""The NLLB-200 tokenizer: FLORES-200 language codes around SentencePiece text.

An NLLB folder carries `tokenizer.json` (read with the `tokenizers` library, preferred, as
transformers prefers the fast tokenizer) and/or `sentencepiece.bpe.model` (read with
`sentencepiece`). Both give the same ids, fairseq's layout, which transformers' `NllbTokenizer`
keeps:

    0 <s>, 1 <pad>, 2 </s>, 3 <unk>          fairseq's specials
    1 .. n                                     SentencePiece piece `i` is id `i + 1` (n pieces;
                                               its own <unk>/<s>/</s> pieces give way to the
                                               specials above; an unknown piece is id 3)
    n + 1 .. n + C                             the C language codes (`eng_Latn`, ...), in order
    n + C + 1                                  <mask>

(unless `tokenizer_config.json`'s `added_tokens_decoder` places them elsewhere).

A source sentence is `[src_lang_code] + tokens + [</s>]` (transformers' default;
`"legacy_behaviour": true` in `tokenizer_config.json` gives `tokens + [</s>, src_lang_code]`);
the decoder starts from `[</s>, tgt_lang_code]` (`decoder_prefix`, the "forced BOS").

From the SentencePiece model, text is split as transformers' converted fast tokenizer splits
it: special tokens written in the text are matched whole; each piece of text between them is
normalized by the model's character map, runs of spaces are squeezed to one (leading and
trailing spaces are kept), and a `▁` is prefixed unless the piece starts with one.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from pathlib import Path

import sentencepiece
from tokenizers import Tokenizer as RustTokenizer

from metrale_jax.errors import CheckpointError, InvalidParameterError
from metrale_jax.text.hf_config import read_json, read_tokenizer_files
from metrale_jax.text.spm_proto import fields, normalizer_spec, write_varint
from metrale_jax.text.tokenizer import Tokenizer, check_unicode

logger = logging.getLogger(__name__)

SENTENCEPIECE_MODEL = "sentencepiece.bpe.model"
TOKENIZER_JSON = "tokenizer.json"
DEFAULT_SRC_LANG = "eng_Latn"
FAIRSEQ_SPECIALS = ("<s>", "<pad>", "</s>", "<unk>")
MASK_TOKEN = "<mask>"
LANG_CODE_PATTERN = re.compile(r"^[a-z]{3}_[A-Z][a-z]{3}$")

# The 202 FLORES-200 codes of NLLB-200, in the order of its vocabulary (transformers'
# `FAIRSEQ_LANGUAGE_CODES`): used when a SentencePiece-only folder does not list its codes.
_FLORES200 = """
ace_Arab ace_Latn acm_Arab acq_Arab aeb_Arab afr_Latn ajp_Arab aka_Latn amh_Ethi apc_Arab
arb_Arab ars_Arab ary_Arab arz_Arab asm_Beng ast_Latn awa_Deva ayr_Latn azb_Arab azj_Latn
bak_Cyrl bam_Latn ban_Latn bel_Cyrl bem_Latn ben_Beng bho_Deva bjn_Arab bjn_Latn bod_Tibt
bos_Latn bug_Latn bul_Cyrl cat_Latn ceb_Latn ces_Latn cjk_Latn ckb_Arab crh_Latn cym_Latn
dan_Latn deu_Latn dik_Latn dyu_Latn dzo_Tibt ell_Grek eng_Latn epo_Latn est_Latn eus_Latn
ewe_Latn fao_Latn pes_Arab fij_Latn fin_Latn fon_Latn fra_Latn fur_Latn fuv_Latn gla_Latn
gle_Latn glg_Latn grn_Latn guj_Gujr hat_Latn hau_Latn heb_Hebr hin_Deva hne_Deva hrv_Latn
hun_Latn hye_Armn ibo_Latn ilo_Latn ind_Latn isl_Latn ita_Latn jav_Latn jpn_Jpan kab_Latn
kac_Latn kam_Latn kan_Knda kas_Arab kas_Deva kat_Geor knc_Arab knc_Latn kaz_Cyrl kbp_Latn
kea_Latn khm_Khmr kik_Latn kin_Latn kir_Cyrl kmb_Latn kon_Latn kor_Hang kmr_Latn lao_Laoo
lvs_Latn lij_Latn lim_Latn lin_Latn lit_Latn lmo_Latn ltg_Latn ltz_Latn lua_Latn lug_Latn
luo_Latn lus_Latn mag_Deva mai_Deva mal_Mlym mar_Deva min_Latn mkd_Cyrl plt_Latn mlt_Latn
mni_Beng khk_Cyrl mos_Latn mri_Latn zsm_Latn mya_Mymr nld_Latn nno_Latn nob_Latn npi_Deva
nso_Latn nus_Latn nya_Latn oci_Latn gaz_Latn ory_Orya pag_Latn pan_Guru pap_Latn pol_Latn
por_Latn prs_Arab pbt_Arab quy_Latn ron_Latn run_Latn rus_Cyrl sag_Latn san_Deva sat_Beng
scn_Latn shn_Mymr sin_Sinh slk_Latn slv_Latn smo_Latn sna_Latn snd_Arab som_Latn sot_Latn
spa_Latn als_Latn srd_Latn srp_Cyrl ssw_Latn sun_Latn swe_Latn swh_Latn szl_Latn tam_Taml
tat_Cyrl tel_Telu tgk_Cyrl tgl_Latn tha_Thai tir_Ethi taq_Latn taq_Tfng tpi_Latn tsn_Latn
tso_Latn tuk_Latn tum_Latn tur_Latn twi_Latn tzm_Tfng uig_Arab ukr_Cyrl umb_Latn urd_Arab
uzn_Latn vec_Latn vie_Latn war_Latn wol_Latn xho_Latn ydd_Hebr yor_Latn yue_Hant zho_Hans
zho_Hant zul_Latn
"""
FLORES200_CODES: tuple[str, ...] = tuple(_FLORES200.split())

_ADD_DUMMY_PREFIX, _REMOVE_EXTRA_WHITESPACES = 3, 4
_NORMALIZER_SPEC = 3


def _without_whitespace_handling(proto: bytes) -> bytes:
    """A copy of a serialized SentencePiece model whose normalizer neither prefixes a space nor
    removes or squeezes whitespace (its character map still applies)."""
    spec = normalizer_spec(proto)
    drop = (_ADD_DUMMY_PREFIX, _REMOVE_EXTRA_WHITESPACES)
    kept = b"".join(spec[start:end] for number, _, start, _, end in fields(spec)
                    if number not in drop)
    for number in drop:
        kept += write_varint(number << 3) + b"\x00"  # varint field set to false
    rest = b"".join(proto[start:end] for number, _, start, _, end in fields(proto)
                    if number != _NORMALIZER_SPEC)
    return rest + write_varint(_NORMALIZER_SPEC << 3 | 2) + write_varint(len(kept)) + kept


class NllbTokenizer(Tokenizer):
    """The NLLB-200 tokenizer (see the module docstring); build it with `load_nllb_tokenizer`.

    Args:
        name: where it came from, for messages.
        lang_ids: language code -> id, in vocabulary order.
        special: special token text -> id (fairseq's four, <mask>, and any other special
            added token); the language codes are special too.
        lstrip: special tokens that swallow the whitespace before them (<mask>).
        src_lang: the source language `encode(text)` uses (`encode_source` takes its own).
        legacy_behaviour: put the language code after `</s>` instead of first.
        rust: a `tokenizers.Tokenizer` (from `tokenizer.json`) for the text, or None;
        spm_proto: else the SentencePiece model's bytes.
    """

    def __init__(self, *, name: str, lang_ids: dict[str, int], special: dict[str, int],
                 lstrip: frozenset[str] = frozenset(), src_lang: str = DEFAULT_SRC_LANG,
                 legacy_behaviour: bool = False, rust: RustTokenizer | None = None,
                 spm_proto: bytes | None = None, extra_eos_ids: Sequence[int] = ()) -> None:
        self._lang_ids = dict(lang_ids)
        self._special = {**special, **self._lang_ids}
        self._special_text = {i: t for t, i in self._special.items()}
        self._legacy = legacy_behaviour
        self._rust = rust
        if rust is not None:
            rust.no_truncation()
            rust.no_padding()
            size = rust.get_vocab_size(with_added_tokens=True)
            self._pieces = 0
        elif spm_proto is not None:
            try:
                self._sp = sentencepiece.SentencePieceProcessor(model_proto=spm_proto)
                self._sp_raw = sentencepiece.SentencePieceProcessor(
                    model_proto=_without_whitespace_handling(spm_proto))
            except Exception as err:  # sentencepiece raises RuntimeError/OSError on bad bytes
                raise CheckpointError(f"{name} is not a SentencePiece model: {err}") from err
            self._pieces = self._sp.get_piece_size()
            size = self._pieces + 1
            parts = sorted(self._special, key=len, reverse=True)
            self._split = re.compile("|".join(
                (r"\s*" if t in lstrip else "") + f"({re.escape(t)})" for t in parts))
            self._group_ids = [self._special[t] for t in parts]
        else:
            raise ValueError("NllbTokenizer needs a tokenizers backend or a SentencePiece model")
        specials = set(self._special.values())
        eos = self._special.get("</s>")
        bos = self._special.get("<s>")
        super().__init__(
            name=name,
            vocab_size=max(size, max(specials, default=-1) + 1),
            bos_token="<s>" if bos is not None else None,
            bos_token_id=bos,
            eos_token="</s>" if eos is not None else None,
            eos_token_ids=[*([eos] if eos is not None else []), *extra_eos_ids],
            pad_token_id=self._special.get("<pad>"),
            add_bos=False,
            special_ids=specials,
        )
        self.src_lang = src_lang if src_lang in self._lang_ids else next(
            iter(self._lang_ids), src_lang)
        """The source language `encode(text)` uses (a code this tokenizer knows)."""

    # ---- languages ----------------------------------------------------------------------

    def lang_codes(self) -> list[str]:
        """Every language code this tokenizer knows (FLORES-200 codes such as `eng_Latn`),
        in vocabulary order."""
        return list(self._lang_ids)

    def lang_code(self, code: str) -> str:
        """`code` if it is a known language code, else `InvalidParameterError` naming it."""
        if code not in self._lang_ids:
            raise InvalidParameterError(
                f"unknown language code {code!r}: NLLB expects a FLORES-200 code such as "
                f"'eng_Latn' or 'fra_Latn' ({len(self._lang_ids)} known: the server's "
                "GET /v1/models lists them under translation.languages, the Python API's "
                "LLM.tokenizer.lang_codes() returns them)", param="lang")
        return code

    def lang_id(self, code: str) -> int:
        """The token id of language `code` (e.g. `eng_Latn`); `InvalidParameterError` for a
        code this tokenizer does not know."""
        return self._lang_ids[self.lang_code(code)]

    @property
    def decoder_start_token_id(self) -> int:
        """The first decoder input: `</s>`."""
        assert self.eos_token_id is not None
        return self.eos_token_id

    def encode_source(self, text: str, src_lang: str) -> list[int]:
        """The encoder input of `text` in language `src_lang`: `[src_lang_code] + tokens +
        [</s>]` (legacy behaviour: `tokens + [</s>, src_lang_code]`), as transformers'
        `NllbTokenizer(src_lang=src_lang)(text).input_ids`."""
        lang = self.lang_id(src_lang)
        ids = self.encode(text, add_special_tokens=False)
        eos = self.decoder_start_token_id
        return [*ids, eos, lang] if self._legacy else [lang, *ids, eos]

    def decoder_prefix(self, tgt_lang: str) -> list[int]:
        """The decoder's first two inputs for a translation into `tgt_lang`:
        `[decoder_start_token_id (</s>), tgt_lang_code]` (the forced BOS)."""
        return [self.decoder_start_token_id, self.lang_id(tgt_lang)]

    # ---- Tokenizer ----------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; with `add_special_tokens`, as `encode_source(text,
        self.src_lang)`. Special tokens written in the text become their ids."""
        check_unicode(text)
        if add_special_tokens:
            return self.encode_source(text, self.src_lang)
        if self._rust is not None:
            return self._rust.encode(text, add_special_tokens=False).ids
        ids: list[int] = []
        pos = 0
        for match in self._split.finditer(text):
            if match.start() > pos:
                ids += self._encode_text(text[pos:match.start()])
            ids.append(self._group_ids[(match.lastindex or 1) - 1])
            pos = match.end()
        if pos < len(text):
            ids += self._encode_text(text[pos:])
        return ids

    def _encode_text(self, text: str) -> list[int]:
        normalized = re.sub("▁{2,}", "▁", self._sp_raw.normalize(text))
        if not normalized:
            return []
        if not normalized.startswith("▁"):
            normalized = "▁" + normalized
        unk = self._special.get("<unk>", 3)
        return [i + 1 if i != self._sp.unk_id() else unk for i in self._sp_raw.encode(normalized)]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """The text of `ids` (special tokens written as their text unless
        `skip_special_tokens`; ids outside the vocabulary are left out)."""
        if self._rust is not None:
            return self._rust.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)
        tokens = [t for t in self.convert_ids_to_tokens(
            [i for i in ids if not (skip_special_tokens and int(i) in self.special_ids)])
            if t is not None]
        text = "".join(tokens).replace("▁", " ")
        return text[1:] if text.startswith(" ") else text

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str | None]:
        """The token text of each id (None outside the vocabulary)."""
        if self._rust is not None:
            return [self._rust.id_to_token(int(i)) for i in ids]
        out: list[str | None] = []
        for raw in ids:
            i = int(raw)
            if i in self._special_text:
                out.append(self._special_text[i])
            elif 1 <= i <= self._pieces:
                out.append(self._sp.id_to_piece(i - 1))
            else:
                out.append(None)
        return out

    def token_to_id(self, token: str) -> int | None:
        """The id of the token text `token`, or None."""
        if token in self._special:
            return self._special[token]
        if self._rust is not None:
            return self._rust.token_to_id(token)
        index = self._sp.piece_to_id(token)
        if index == self._sp.unk_id() and token != self._sp.id_to_piece(index):
            return None
        return index + 1


def load_nllb_tokenizer(folder: Path | str, src_lang: str | None = None) -> NllbTokenizer:
    """The NLLB tokenizer of a folder: `tokenizer.json` when present, else
    `sentencepiece.bpe.model`, with `tokenizer_config.json` / `special_tokens_map.json`.

    src_lang: the default source language of `encode` (else the config's `src_lang`, else
    `eng_Latn`). Raises `CheckpointError` when neither file is there or one cannot be read.
    """
    folder = Path(folder)
    files = read_tokenizer_files(folder)
    config_path = folder / "tokenizer_config.json"
    config = read_json(config_path) if config_path.is_file() else {}
    legacy = bool(config.get("legacy_behaviour", False))
    src = src_lang or config.get("src_lang") or DEFAULT_SRC_LANG
    json_path, spm_path = folder / TOKENIZER_JSON, folder / SENTENCEPIECE_MODEL
    if json_path.is_file():
        try:
            rust = RustTokenizer.from_file(str(json_path))
        except Exception as err:  # the Rust library raises a bare Exception on a bad file
            raise CheckpointError(f"cannot load {json_path}: {err}") from err
        added = rust.get_added_tokens_decoder()
        special = {t.content: i for i, t in added.items() if t.special}
        for token in FAIRSEQ_SPECIALS:
            if token not in special and (i := rust.token_to_id(token)) is not None:
                special[token] = i
        lang_ids = {t: i for t, i in sorted(special.items(), key=lambda kv: kv[1])
                    if LANG_CODE_PATTERN.match(t)}
        special = {t: i for t, i in special.items() if t not in lang_ids}
        tokenizer = NllbTokenizer(name=str(folder), lang_ids=lang_ids, special=special,
                                  src_lang=src, legacy_behaviour=legacy, rust=rust,
                                  extra_eos_ids=files.generation_eos_ids)
    elif spm_path.is_file():
        proto = spm_path.read_bytes()
        try:
            pieces = sentencepiece.SentencePieceProcessor(model_proto=proto).get_piece_size()
        except Exception as err:  # sentencepiece raises RuntimeError/OSError on bad bytes
            raise CheckpointError(f"{spm_path} is not a SentencePiece model: {err}") from err
        placed = {spec.content: i for i, spec in files.added_tokens.items() if spec.special}
        codes = [t for t in files.extra_special_tokens if LANG_CODE_PATTERN.match(t)]
        codes = codes or [t for t in placed if LANG_CODE_PATTERN.match(t)] or list(
            FLORES200_CODES)
        lang_ids = {c: placed.get(c, pieces + 1 + k) for k, c in enumerate(codes)}
        special = {t: k for k, t in enumerate(FAIRSEQ_SPECIALS)}
        special[MASK_TOKEN] = pieces + 1 + len(codes)
        special |= {t: i for t, i in placed.items() if t not in lang_ids}
        lstrip = frozenset(s.content for s in files.added_tokens.values() if s.lstrip) | {
            MASK_TOKEN}
        tokenizer = NllbTokenizer(name=str(folder), lang_ids=lang_ids, special=special,
                                  lstrip=lstrip, src_lang=src, legacy_behaviour=legacy,
                                  spm_proto=proto, extra_eos_ids=files.generation_eos_ids)
    else:
        raise CheckpointError(f"no NLLB tokenizer in {folder}: expected {TOKENIZER_JSON} or "
                              f"{SENTENCEPIECE_MODEL}")
    if not tokenizer.lang_codes():
        raise CheckpointError(f"{folder}: the tokenizer has no language codes (eng_Latn, ...)")
    if src_lang is not None:
        tokenizer.src_lang = tokenizer.lang_code(src_lang)
    logger.info("loaded NLLB tokenizer %s (%d languages)", folder, len(tokenizer.lang_codes()))
    return tokenizer
