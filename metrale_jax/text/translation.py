"""Translation requests for an encoder-decoder (NLLB / M2M100) model: languages and inputs.

A translation is one text in a source language and a target language. The encoder reads
`[source language code] + text tokens + [</s>]`; the decoder starts from
`[</s>, target language code]` (the target language is forced as the first generated token,
as transformers' `forced_bos_token_id`), and what it generates after that is the translation.

Languages are FLORES-200 codes (`eng_Latn`, `fra_Latn`, ...). A request may leave either
language out (None, "" or 0): the deployment's default (`--source-lang` / `--target-lang`)
applies, and a request with neither its own nor a default is refused.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from metrale_jax.errors import InvalidParameterError


@dataclasses.dataclass(frozen=True)
class TranslationInputs:
    """One translation's token ids: source (the encoder's input) and prompt (the decoder's
    first inputs, `[</s>, target language]`), with the languages resolved."""

    source: tuple[int, ...]
    prompt: tuple[int, ...]
    source_lang: str
    target_lang: str


def pick_language(value: Any, default: str | None, param: str) -> str:
    """The language a request names (`value`: a code, or None / "" / 0 for `default`);
    `InvalidParameterError` (naming `param`) when there is neither or it is not a string."""
    if value is None or value == "" or (isinstance(value, int) and not isinstance(value, bool)
                                        and value == 0):
        if default is None:
            raise InvalidParameterError(
                f"{param} is required: this server has no default (start it with "
                f"--{param.replace('_', '-')})", param=param)
        return default
    if not isinstance(value, str):
        raise InvalidParameterError(f"{param} must be a FLORES-200 language code such as "
                                    "'eng_Latn'", param=param)
    return value


def translation_inputs(tokenizer, text: str, source_lang: Any, target_lang: Any,
                       default_source: str | None = None,
                       default_target: str | None = None) -> TranslationInputs:
    """The token ids of translating `text` from `source_lang` into `target_lang` (codes, or
    empty for the defaults) with an `NllbTokenizer`. An unknown code is an
    `InvalidParameterError` naming the field and the code."""
    if not isinstance(text, str):
        raise InvalidParameterError("the text to translate must be a string", param="prompt")
    if not text.strip():
        raise InvalidParameterError("the text to translate is empty", param="prompt")
    src = pick_language(source_lang, default_source, "source_lang")
    tgt = pick_language(target_lang, default_target, "target_lang")
    for code, param in ((src, "source_lang"), (tgt, "target_lang")):
        try:
            tokenizer.lang_code(code)
        except InvalidParameterError as e:
            raise InvalidParameterError(f"{param}: {e.message}", param=param) from None
    return TranslationInputs(tuple(tokenizer.encode_source(text, src)),
                             tuple(tokenizer.decoder_prefix(tgt)), src, tgt)


def check_default_languages(tokenizer, source_lang: str | None,
                            target_lang: str | None) -> None:
    """Checks a deployment's default languages against the tokenizer (at startup)."""
    for code, param in ((source_lang, "source_lang"), (target_lang, "target_lang")):
        if code is not None:
            try:
                tokenizer.lang_code(code)
            except InvalidParameterError as e:
                raise InvalidParameterError(f"--{param.replace('_', '-')}: {e.message}",
                                            param=param) from None


__all__ = ["TranslationInputs", "check_default_languages", "pick_language",
           "translation_inputs"]
