"""`EncoderPooler`: a BERT-family model (BERT, RoBERTa, XLM-RoBERTa) served for embeddings
(kind "encoder") or pair scores (kind "cross-encoder"), over an `EncoderRunner`.

Texts are tokenized as sentence-transformers does: the tokenizer's post-processor adds the
special tokens (`[CLS] text [SEP]`, `<s> text </s>`; pairs `[CLS] q [SEP] d [SEP]` with token
types 0 / 1, or `<s> q </s></s> d </s>`), lowercased first when `sentence_bert_config.json`
says `do_lower_case`. Truncation, when asked, is the tokenizer's own (pairs: longest first)
to the model's limit, as sentence-transformers and `CrossEncoder` truncate.

`load_encoder_pooler(path)` builds one from a folder `is_encoder_folder(path)` accepts.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer as RustTokenizer

from metrale_jax.embedding.encoder_buckets import bucket_grid
from metrale_jax.embedding.encoder_runner import EncoderRunner
from metrale_jax.embedding.pooler import Pooler, PoolerInfo, cosine_scores
from metrale_jax.engine.programs import enable_compilation_cache
from metrale_jax.errors import CheckpointError, ContextLengthError, InvalidParameterError
from metrale_jax.models.bert import BertEncoder
from metrale_jax.text.loader import load_tokenizer
from metrale_jax.text.tokenizer import Tokenizer
from metrale_jax.weights.encoder_reader import (
    EncoderSetup,
    is_encoder_folder,
    load_bert_params,
    read_encoder_setup,
)

log = logging.getLogger(__name__)


def check_lengths(lengths: Sequence[int], limit: int, what: str = "input") -> None:
    """Raises `ContextLengthError` naming the first input (by index) over `limit` tokens,
    `InvalidParameterError` for an empty one."""
    for i, n in enumerate(lengths):
        if n < 1:
            raise InvalidParameterError(f"{what} {i} is empty", param="input")
        if n > limit:
            raise ContextLengthError(
                f"{what} {i} has {n} tokens, more than this model's limit of {limit} "
                f"tokens", param="input")


class EncoderPooler(Pooler):
    """An encoder model as a `Pooler` (see the module docstring).

    setup: the folder's `EncoderSetup`; model: its `BertEncoder`; tokenizer: its tokenizer
    (a `tokenizer.json` one); max_rows, token_budget, min_length: the program grid (row
    buckets 1 .. max_rows, length buckets min_length .. the limit, R * S <= token_budget)."""

    def __init__(self, setup: EncoderSetup, model: BertEncoder, tokenizer: Tokenizer, *,
                 max_rows: int = 256, token_budget: int = 8192, min_length: int = 16):
        backend = getattr(tokenizer, "backend", None)
        if not isinstance(backend, RustTokenizer):
            raise CheckpointError(f"{setup.model_folder}: an encoder needs tokenizer.json")
        self.setup = setup
        self.tokenizer = tokenizer
        self._backend = backend
        self._truncating = RustTokenizer.from_str(backend.to_str())
        self._truncating.no_padding()
        self._truncating.enable_truncation(setup.max_tokens, strategy="longest_first")
        cross = setup.cross_encoder
        E = setup.config.hidden_size
        self.info = PoolerInfo(
            task="score" if cross else "embed", kind="cross-encoder" if cross else "encoder",
            max_input_tokens=setup.max_tokens,
            dimensions=None if cross else E * len(setup.pooling),
            matryoshka=setup.matryoshka and not cross,
            pooling=None if cross else "+".join(setup.pooling), normalize=setup.normalize)
        self.grid = bucket_grid(setup.max_tokens, max_rows, token_budget, min_length)
        self.runner = EncoderRunner(model, setup.pooling, setup.normalize, self.grid,
                                    setup.activation)

    # ---- tokens ----------------------------------------------------------------------------

    def _text(self, text: str) -> str:
        return text.lower() if self.setup.lowercase else text

    def encode_text(self, text: str) -> list[int]:
        """`text`'s ids (after the model's default prompt, if any) with the special tokens,
        untruncated."""
        return self.tokenizer.encode(self._text(self.setup.prompt + text))

    def encode_text_truncated(self, text: str) -> list[int]:
        """`encode_text`, cut to `max_input_tokens` as sentence-transformers cuts (the
        special tokens kept)."""
        return self._truncating.encode(self._text(self.setup.prompt + text)).ids

    def encode_pair(self, query: str, document: str,
                    truncate: bool = False) -> tuple[list[int], list[int]]:
        """A (query, document) pair's ids and token types as the model reads them; cut
        longest-first to `max_input_tokens` when `truncate` (types all 0 where the tokenizer
        passes none: `EncoderSetup.token_types`)."""
        backend = self._truncating if truncate else self._backend
        enc = backend.encode(self._text(query), self._text(document))
        types = enc.type_ids if self.setup.token_types else [0] * len(enc.ids)
        return enc.ids, types

    # ---- Pooler ----------------------------------------------------------------------------

    def embed_ids(self, inputs: Sequence[Sequence[int]]) -> np.ndarray:
        """Embeddings `[N, E] float32` of N token-id lists (see `Pooler.embed_ids`); an input
        over the limit raises `ContextLengthError` naming its index."""
        if self.setup.cross_encoder:
            raise InvalidParameterError("this model is a cross-encoder: it scores pairs and "
                                        "serves no embeddings", param="model")
        check_lengths([len(ids) for ids in inputs], self.info.max_input_tokens)
        vocab = self.setup.config.vocab_size
        for i, ids in enumerate(inputs):
            if any(not 0 <= t < vocab for t in ids):
                raise InvalidParameterError(
                    f"input {i} has a token id outside this model's vocabulary (0 .. "
                    f"{vocab - 1})", param="input")
        return self.runner.run([(list(ids), None) for ids in inputs])

    def score_texts(self, query: str, documents: Sequence[str],
                    truncate: bool = False) -> tuple[np.ndarray, int]:
        """Scores `[N] float32` of the documents against `query` and the tokens read (see
        `Pooler.score_texts`): a cross-encoder's logit per pair through its activation
        (sigmoid unless its config names another, as `CrossEncoder.predict`), an
        embedder's cosine similarity."""
        limit = self.info.max_input_tokens
        if self.setup.cross_encoder:
            pairs = [self.encode_pair(query, d, truncate) for d in documents]
            check_lengths([len(ids) for ids, _ in pairs], limit)
            scores = self.runner.run(pairs)[:, 0] if pairs else np.zeros(0, np.float32)
            return scores.astype(np.float32), sum(len(ids) for ids, _ in pairs)
        encode = self.encode_text_truncated if truncate else self.encode_text
        q = encode(query)
        docs = [encode(d) for d in documents]
        if len(q) > limit:
            raise ContextLengthError(f"the query has {len(q)} tokens, more than this "
                                     f"model's limit of {limit} tokens", param="query")
        check_lengths([len(d) for d in docs], limit)
        vectors = self.runner.run([(ids, None) for ids in [q, *docs]])
        return cosine_scores(vectors[0], vectors[1:]), len(q) + sum(len(d) for d in docs)

    @property
    def compile_count(self) -> int:
        """Programs compiled so far (flat after `warmup`)."""
        return self.runner.compile_count

    def warmup(self) -> None:
        """Compiles every (rows, length) program of the grid."""
        seconds = self.runner.warmup()
        log.info("encoder: %d programs ready in %.1f s", len(self.grid.shapes()), seconds)

    def close(self) -> None:
        """Stops the worker thread; calls after it raise."""
        self.runner.close()


def load_encoder_pooler(path: Path | str, dtype: str = "float32", *, max_rows: int = 256,
                        token_budget: int = 8192, min_length: int = 16,
                        compilation_cache_dir: str | None = None,
                        max_len: int | None = None) -> EncoderPooler:
    """An `EncoderPooler` for the encoder folder at `path` (a sentence-transformers folder or
    a bare HF `Bert*` / `XLMRoberta*` / `Roberta*` one) with params in `dtype`; the grid
    options as `EncoderPooler`'s; compilation_cache_dir: turns on JAX's persistent cache
    there (None: left as it is); max_len: a limit on the inputs below the model's own (None:
    the model's). Not warmed up: call `warmup()`."""
    enable_compilation_cache(compilation_cache_dir)
    setup = read_encoder_setup(path)
    if max_len is not None and max_len < setup.max_tokens:
        setup = dataclasses.replace(setup, max_tokens=max_len)
    model = load_bert_params(setup, dtype)
    tokenizer = load_tokenizer(setup.model_folder)
    return EncoderPooler(setup, model, tokenizer, max_rows=max_rows,
                         token_budget=token_budget, min_length=min_length)


__all__ = ["EncoderPooler", "check_lengths", "is_encoder_folder", "load_encoder_pooler"]
