"""The text-splitting regexes llama.cpp uses for each `tokenizer.ggml.pre` of a byte-level BPE.

A GGUF file stores a byte-level BPE vocabulary and merges, but not its pre-tokenizer; it names it
in `tokenizer.ggml.pre` instead ("smollm", "llama-bpe", "qwen2", ...). llama.cpp maps each name to
a list of regexes, applied one after the other, each splitting the pieces the previous left
(text no regex matches stays a piece of its own). This table holds the same lists, written in the
Oniguruma syntax of the `tokenizers` library (original `tokenizer.json` forms where llama.cpp
rewrote them for its own regex engine).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PreTokenizerSpec:
    """How a byte-level BPE splits text before merging.

    Attributes:
        regexes: applied in order, each isolating its matches.
        ignore_merges: a piece that is itself a vocabulary entry becomes that token directly
            (llama.cpp's and `tokenizer.json`'s `ignore_merges`, used by Llama 3).
        add_bos: llama.cpp's default for `tokenizer.ggml.add_bos_token` when the file lacks it.
    """

    regexes: tuple[str, ...]
    ignore_merges: bool = False
    add_bos: bool = False


GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_CONTRACTIONS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"
LLAMA3_REGEX = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_REGEX = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_UPPER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]"
_LOWER = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
TEKKEN_REGEX = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
GPT4O_REGEX = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+{_CONTRACTIONS}?"
    rf"|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*{_CONTRACTIONS}?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PORO_REGEX = r" ?[^(\s|.,!?…。，、।۔،)]+"

_GPT2 = PreTokenizerSpec((GPT2_REGEX,))
_DIGITS_GPT2 = PreTokenizerSpec((r"\p{N}", GPT2_REGEX))
_LLAMA3 = PreTokenizerSpec((LLAMA3_REGEX,), ignore_merges=True, add_bos=True)
_QWEN2 = PreTokenizerSpec((QWEN2_REGEX,))


def _each(names: str, spec: PreTokenizerSpec) -> dict[str, PreTokenizerSpec]:
    return dict.fromkeys(names.split(), spec)


PRE_TOKENIZERS: dict[str, PreTokenizerSpec] = {
    "default": PreTokenizerSpec(
        (r"[\p{P}\$\+<=>\^~\|]+", GPT2_REGEX, r"\p{N}+", r"[0-9][0-9][0-9]")
    ),
    **_each("llama3 llama-v3 llama-bpe falcon3 falcon-h1 pixtral midm-2.0 lfm2", _LLAMA3),
    **_each("dbrx smaug-bpe chatglm-bpe glm4", PreTokenizerSpec((LLAMA3_REGEX,))),
    "falcon": PreTokenizerSpec((r"[\p{P}\$\+<=>\^~\|`]+", GPT2_REGEX, r"[0-9][0-9][0-9]")),
    **_each("starcoder refact command-r smollm codeshell exaone minerva-7b", _DIGITS_GPT2),
    **_each(
        "gpt2 gpt-2 phi-2 jina-es jina-de gigachat jina-v2-es jina-v2-de jina-v1-en jina-v2-code "
        "roberta-bpe mpt olmo jais exaone4 trillion granite-docling a.x-4.0 mellum",
        _GPT2,
    ),
    **_each("qwen2 deepseek-r1-qwen kormo stablelm2 megrez hunyuan", _QWEN2),
    "deepseek-coder": PreTokenizerSpec(
        (r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", r"[一-龥ࠀ-一가-퟿]+", r"\p{N}")
    ),
    "deepseek-v3": PreTokenizerSpec(
        (
            r"\p{N}{1,3}",
            r"[一-龥぀-ゟ゠-ヿ]+",
            r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
            r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
        )
    ),
    "tekken": PreTokenizerSpec((TEKKEN_REGEX,), ignore_merges=True, add_bos=True),
    **_each("gpt-4o llama4 minimax-m2", PreTokenizerSpec((GPT4O_REGEX,))),
    **_each("poro-chat bloom gpt3-finnish", PreTokenizerSpec((_PORO_REGEX,))),
    "viking": PreTokenizerSpec((_PORO_REGEX, r"\p{N}")),
}


def pre_tokenizer_spec(name: str | None) -> PreTokenizerSpec:
    """The spec for `tokenizer.ggml.pre` = `name`; an unknown or missing name gets GPT-2's."""
    spec = PRE_TOKENIZERS.get((name or "").lower())
    if spec is None:
        logger.warning(
            "unknown GGUF pre-tokenizer %r; splitting text with the GPT-2 regex, so tokens may "
            "differ from the model's own tokenizer",
            name,
        )
        return _GPT2
    return spec
