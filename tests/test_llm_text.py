"""The Python API refuses text that is not Unicode with a ValueError naming the problem."""

from __future__ import annotations

import pytest

LONE = "a\ud800b"  # a lone UTF-16 surrogate: a Python str may hold one; no tokenizer encodes it


def test_generate_and_chat_refuse_a_lone_surrogate(default_llm):
    """`LLM.generate` and `LLM.chat` with a lone surrogate raise a ValueError (an
    `InvalidTextError`) saying where it is, before anything is submitted (was the Rust
    tokenizer's `TypeError: TextInputSequence must be str`)."""
    from metrale_jax.errors import InvalidParameterError

    with pytest.raises(ValueError, match="lone UTF-16 surrogate \\(U\\+D800 at character 1\\)"):
        default_llm.generate(LONE)
    with pytest.raises(ValueError, match="surrogate") as caught:
        default_llm.chat([{"role": "user", "content": LONE}])
    assert isinstance(caught.value, InvalidParameterError)  # the server's 400
