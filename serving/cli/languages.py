"""The translation flags of `metrale serve` and `metrale generate` (NLLB / M2M100 models).

    --source-lang eng_Latn --target-lang fra_Latn   FLORES-200 codes (serve: the defaults of
                                                    requests that name none)
    --max-source-len 512                            the longest text to translate, in tokens
                                                    (the engine's `max_source_len`)

`translation_model(model, source_lang, target_lang)` tells whether a model is a translation
model from its files, before any weight is read, and checks the codes against its tokenizer,
so a wrong flag fails at once (exit code 2) rather than after loading.
"""

from __future__ import annotations

import argparse

from metrale_jax.errors import InvalidParameterError


def add_language_flags(parser: argparse.ArgumentParser, defaults: bool = True) -> None:
    """Adds --source-lang, --target-lang and --max-source-len; `defaults`: the languages are
    the server's defaults (serve), else those of the one translation (generate)."""
    group = parser.add_argument_group("translation models (NLLB / M2M100)")
    what = "the default {} language of requests that name none" if defaults else "the {} language"
    group.add_argument("--source-lang", default=None, metavar="CODE",
                       help=what.format("source") + " (a FLORES-200 code such as eng_Latn)")
    group.add_argument("--target-lang", default=None, metavar="CODE",
                       help=what.format("target") + " (a FLORES-200 code such as fra_Latn)")
    group.add_argument("--max-source-len", type=int, default=None, metavar="N",
                       help="the longest text to translate, in tokens (default: the "
                            "engine's, 512)")


def source_len_option(args: argparse.Namespace) -> dict[str, int]:
    """The `EngineConfig` field --max-source-len sets ({} when not given); raises
    `InvalidParameterError` below 2."""
    if args.max_source_len is None:
        return {}
    if args.max_source_len < 2:
        raise InvalidParameterError("--max-source-len must be >= 2", param="max_source_len")
    return {"max_source_len": args.max_source_len}


def translation_model(model: str, source_lang: str | None = None,
                      target_lang: str | None = None) -> bool:
    """True when `model` (a name or path, as `--model` takes) is a translation model. Checks
    the language codes: known to its tokenizer, or absent for a decoder-only model (raises
    `InvalidParameterError`; a missing model raises as loading it would)."""
    from metrale_jax.weights.checkpoint import resolve
    from metrale_jax.weights.m2m100_reader import is_m2m100_folder
    path, fmt = resolve(model)
    translation = fmt in ("hf", "orbax") and is_m2m100_folder(path, fmt)
    if not translation:
        for code, flag in ((source_lang, "--source-lang"), (target_lang, "--target-lang")):
            if code is not None:
                raise InvalidParameterError(
                    f"{flag} is for translation models (NLLB / M2M100); {model!r} is a "
                    "decoder-only model", param=flag[2:].replace("-", "_"))
        return False
    if source_lang is not None or target_lang is not None:
        from metrale_jax.text.nllb import load_nllb_tokenizer
        from metrale_jax.text.translation import check_default_languages
        tokenizer = load_nllb_tokenizer(path / "tokenizer" if fmt == "orbax" else path)
        check_default_languages(tokenizer, source_lang, target_lang)
    return True
