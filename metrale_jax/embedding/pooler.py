"""`Pooler`: what the HTTP layer, `LLM.embed` / `LLM.score` and `metrale embed` call on a
model served for embeddings (`task == "embed"`) or for scores (`task == "score"`).

Four kinds implement it:
- "encoder": a BERT-family model pooled as its sentence-transformers config says (mean,
  cls, last token, max) and maybe normalized: embeddings; its rerank is cosine similarity.
- "cross-encoder": a `*ForSequenceClassification` encoder over (query, document) pairs.
- "decoder-embedding": a decoder family's final hidden state at the last token (Qwen3-
  Embedding), through the scheduler's ragged steps as prefill-only pieces.
- "decoder-reranker": the same hidden state scored from the "yes" / "no" logits
  (Qwen3-Reranker): sigmoid(logit_yes - logit_no).

Every method is thread-safe and blocking: call it from a worker thread (the HTTP layer uses
`asyncio.to_thread`). Concurrent callers' inputs are batched together by the implementation.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np

from metrale_jax.errors import InvalidParameterError

Task = Literal["embed", "score"]
Kind = Literal["encoder", "cross-encoder", "decoder-embedding", "decoder-reranker"]


@dataclasses.dataclass(frozen=True)
class PoolerInfo:
    """What a pooling model serves, as /v1/models and the errors name it.

    task: "embed" (vectors; rerank by cosine) or "score" (pair scores only).
    kind: one of `Kind`. max_input_tokens: the longest input (or pair) in tokens, special
    tokens included. dimensions: the embedding size E (None for a scorer). matryoshka: a
    request's `dimensions` may truncate the vector (the model was trained for it or its
    config says so). pooling: "mean" | "cls" | "last" | "max" (None for a scorer);
    normalize: vectors are L2-normalized."""

    task: Task
    kind: Kind
    max_input_tokens: int
    dimensions: int | None
    matryoshka: bool = False
    pooling: str | None = None
    normalize: bool = False


class Pooler(abc.ABC):
    """A loaded pooling model. Attributes: `info` (`PoolerInfo`), `tokenizer` (a
    `metrale_jax.text.Tokenizer`)."""

    info: PoolerInfo
    tokenizer: Any

    @abc.abstractmethod
    def encode_text(self, text: str) -> list[int]:
        """`text`'s token ids as the model embeds it: with its special tokens (BERT's [CLS]
        ... [SEP]; a decoder embedder's end token), untruncated."""

    @abc.abstractmethod
    def embed_ids(self, inputs: Sequence[Sequence[int]]) -> np.ndarray:
        """Embeddings `[N, E] float32` of N token-id lists (each 1..max_input_tokens long,
        checked by the caller), pooled and normalized as `info` says. Raises for a scorer."""

    @abc.abstractmethod
    def score_texts(self, query: str, documents: Sequence[str],
                    truncate: bool = False) -> tuple[np.ndarray, int]:
        """Relevance of each document to `query`: `([N] float32, tokens)`, the scores
        (a cross-encoder's logit through a sigmoid when it has one label; a decoder
        reranker's P(yes); an embedder's cosine similarity) and the tokens read. An input
        longer than `max_input_tokens` raises `ContextLengthError` naming its index, or is
        cut to fit when `truncate`."""

    @property
    def compile_count(self) -> int:
        """Programs compiled so far (flat after warmup)."""
        return 0

    def warmup(self) -> None:  # noqa: B027 - optional
        """Compiles every program of the grid (no-op where the pooler compiles nothing)."""

    def close(self) -> None:  # noqa: B027 - optional
        """Stops the pooler's worker threads; calls after it raise."""


def cosine_scores(query: np.ndarray, documents: np.ndarray) -> np.ndarray:
    """Cosine similarity `[N] float32` of `query` `[E]` with each row of `documents`
    `[N, E]` (zero vectors score 0)."""
    q = query / max(float(np.linalg.norm(query)), 1e-12)
    d = documents / np.maximum(np.linalg.norm(documents, axis=1, keepdims=True), 1e-12)
    return (d @ q).astype(np.float32)


def shortened(vectors: np.ndarray, dimensions: int | None, info: Any) -> np.ndarray:
    """`vectors` `[N, E]` cut to `dimensions` (Matryoshka) and re-normalized when the model
    normalizes; 400 for a model not trained for it or a size above E."""
    if dimensions is None or dimensions == vectors.shape[1]:
        return vectors
    size = vectors.shape[1]
    if dimensions > size:
        raise InvalidParameterError(f"dimensions={dimensions}: this model's embeddings have "
                                    f"{size} dimensions", param="dimensions")
    if not info.matryoshka:
        raise InvalidParameterError(
            f"dimensions={dimensions}: this model was not trained for shortened (Matryoshka) "
            f"embeddings; its embeddings have {size} dimensions", param="dimensions")
    out = vectors[:, :dimensions]
    if info.normalize:
        out = out / np.maximum(np.linalg.norm(out, axis=1, keepdims=True), 1e-12)
    return out.astype(np.float32)
