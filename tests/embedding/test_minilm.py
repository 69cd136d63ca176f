"""The real all-MiniLM-L6-v2 (a 6-layer BERT, mean pooling, normalized) against
sentence-transformers' `encode` on the same folder, float32: batched and one at a time.
Skipped when `checkpoints/all-MiniLM-L6-v2` is absent (`metrale pull all-minilm-l6-v2`)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from metrale_jax.embedding.encoder_pooler import load_encoder_pooler

FOLDER = Path(__file__).resolve().parents[2] / "checkpoints" / "all-MiniLM-L6-v2"
SENTENCES = [
    "A man is eating food.",
    "A man is riding a white horse on an enclosed ground.",
    "The new movie is awesome",
    "Two men pushed carts through the woods.",
    "Paris is the capital and most populous city of France.",
    "How do I reset my password if I no longer have access to my email?",
    "Photosynthesis converts light energy into chemical energy stored in glucose.",
    "¿Dónde está la biblioteca?",
    "Der schnelle braune Fuchs springt über den faulen Hund.",
    "東京は日本の首都です。",
    "I love 🍕 and ☕!!!",
    "def fib(n): return n if n < 2 else fib(n - 1) + fib(n - 2)",
    "SELECT name, COUNT(*) FROM users GROUP BY name HAVING COUNT(*) > 1;",
    "ok",
    "The quarterly report shows revenue grew 12% year over year, driven by strong demand "
    "in the Asia-Pacific region, while operating costs stayed flat despite inflation.",
    "Mitochondria are the powerhouse of the cell.",
    "   leading and trailing spaces   ",
    "UPPER CASE TEXT SHOULD EMBED LIKE THE TOKENIZER SAYS",
    "e-mail: someone@example.com, phone: +1 (555) 010-9999",
    "A long sentence " + "that keeps going and going " * 12 + "until it finally ends.",
]


@pytest.fixture(scope="module")
def minilm_path() -> Path:
    if not (FOLDER / "config.json").is_file():
        pytest.skip(f"{FOLDER} is absent (metrale pull all-minilm-l6-v2)")
    return FOLDER


@pytest.fixture(scope="module")
def minilm(minilm_path):
    pooler = load_encoder_pooler(minilm_path, max_rows=32, token_budget=2048)
    yield pooler
    pooler.close()


@pytest.fixture(scope="module")
def reference(minilm_path) -> np.ndarray:
    from sentence_transformers import SentenceTransformer
    return SentenceTransformer(str(minilm_path), device="cpu").encode(SENTENCES)


def _within_cosine(ours: np.ndarray, ref: np.ndarray) -> None:
    cos = np.sum(ours * ref, 1) / (np.linalg.norm(ours, axis=1) * np.linalg.norm(ref, axis=1))
    assert np.all(1 - cos < 1e-5), cos
    np.testing.assert_allclose(ours, ref, atol=1e-5)


def test_minilm_info(minilm):
    info = minilm.info
    assert (info.kind, info.pooling, info.normalize, info.dimensions) == (
        "encoder", "mean", True, 384)
    assert info.max_input_tokens == 256 and info.matryoshka is False


def test_minilm_batched_matches_sentence_transformers(minilm, reference):
    ours = minilm.embed_ids([minilm.encode_text(s) for s in SENTENCES])
    _within_cosine(ours, reference)


def test_minilm_one_at_a_time_matches_sentence_transformers(minilm, reference):
    ours = np.stack([minilm.embed_ids([minilm.encode_text(s)])[0] for s in SENTENCES])
    _within_cosine(ours, reference)
