"""The default model (SmolLM2-135M-Instruct, Q4_1 GGUF) against transformers on the same file.

transformers dequantizes the GGUF to float32 (`from_pretrained(folder, gguf_file=name)`); our
float32 logits on the same token ids must agree within 1e-4 · max|logit| with the same argmax
at every position, on five prompts, one of them chat-templated.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "Once upon a time, in a land far away, there lived a",
    "Ünïcödé, emoji 🎉 and 中文 text mixed together:",
]


pytestmark = pytest.mark.xdist_group("default-model")  # shares the session's default LLM


@pytest.fixture(scope="module")
def models(default_llm, default_transformers):
    return default_llm, default_transformers


def _prompts(ours) -> list[list[int]]:
    chat = ours.apply_chat_template([
        {"role": "system", "content": "You are a concise assistant."},
        {"role": "user", "content": "Name three primary colours."},
    ])
    texts = [*PROMPTS, chat]
    return [ours.tokenizer.encode(t, add_special_tokens=False) for t in texts]


def test_config_matches_the_gguf(models):
    ours, ref = models
    cfg, rc = ours.config, ref.config
    assert cfg.architecture == "llama"
    assert (cfg.vocab_size, cfg.num_layers, cfg.hidden_size) == (49152, 30, 576)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (9, 3, 64)
    assert cfg.tie_word_embeddings
    assert cfg.rope_theta == pytest.approx(rc.rope_parameters["rope_theta"])
    assert ours.tokenizer.decode([2]) == "<|im_end|>"
    assert 2 in ours.eos_token_ids


def test_logits_match_transformers(models):
    ours, ref = models
    for ids in _prompts(ours):
        with torch.no_grad():
            want = ref(torch.tensor([ids])).logits[0].float().numpy()
        got = ours.logits(ids)
        err = np.abs(got - want).max() / np.abs(want).max()
        assert err <= 1e-4, f"max relative logit error {err:.2e} on {len(ids)} tokens"
        np.testing.assert_array_equal(got.argmax(-1), want.argmax(-1))
