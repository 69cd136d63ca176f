"""Texts the tokenizer tests compare on, and generated training text for tiny vocabularies."""

from __future__ import annotations

import random

TEXTS: list[str] = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "It's what they'll say: we're sure you've done it, I'm told he'd know.",
    "Café crème brûlée, naïve façade, jalapeño, Ångström, Łódź, straße, ÆØÅ.",
    "東京は日本の首都です。我爱自然语言处理。한국어 텍스트도 있습니다.",
    "Emoji: 😀 🎉 👍🏽 🇫🇷 👨‍👩‍👧‍👦 ❤️ 🚀🧠",
    "def add(a, b):\n    return a + b\n\nprint(add(1, 2))\n",
    "for (int i = 0; i < 10; ++i) {\n\tsum += i * 2; // done\n}",
    '{"key": [1, 2.5, null], "nested": {"x": "y"}}',
    "   leading spaces and trailing   ",
    "tabs\tand\t\ttabs\n\n\nthree newlines\r\nwindows line\r\n",
    "Numbers 12345 and 3.14159 and 1,000,000 and 2024-01-31.",
    "Ελληνικά κείμενα και русский текст тоже.",
    "مرحبا بالعالم — עברית גם.",
    "mixed中文and English混合text",
    "x",
    " ",
    "\n",
    "",
]

# Special tokens written in the text, for tokenizers that have them.
SMOLLM_SPECIAL_TEXTS: list[str] = [
    "<|im_start|>user\nHi there!<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>system\nBe brief.<|im_end|><|endoftext|>",
    "before<|im_end|>after",
    "<repo_name>metrale<file_sep>main.py\n<filename>x",
    "<|im_start|><|im_start|> <|im_end|>",
]

_SYLLABLES = [
    "ka",
    "to",
    "ri",
    "men",
    "sa",
    "lo",
    "qu",
    "ex",
    "tion",
    "ing",
    "er",
    "pre",
    "con",
    "al",
    "is",
    "th",
    "an",
    "é",
    "ß",
    "日本",
    "語",
]


def training_lines(count: int = 4000, seed: int = 0) -> list[str]:
    """Deterministic pseudo-text (made-up words plus the corpus) to train tiny vocabularies."""
    rng = random.Random(seed)
    lines = []
    for i in range(count):
        words = [
            "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 4)))
            for _ in range(rng.randint(3, 12))
        ]
        lines.append(" ".join(words) + rng.choice([".", ",", "!", "?", ""]))
        lines.append(TEXTS[i % len(TEXTS)])
    return lines
