"""The work behind the pooling routes (serving/http/routes/pooling.py): a model served for
embeddings or scores (`ModelRuntime.pooler`, a `metrale_jax.embedding.Pooler`).

Each request is checked against the model (what it serves, input lengths, token ids,
`dimensions`), reserves its tokens against the caller's limits like a generation
(`PoolingJob`, what `Access` and the request dump read), runs the pooler in a worker thread
(the pooler batches concurrent requests' inputs together) and answers in its API's shape.
"""

from __future__ import annotations

import asyncio
import base64
import time
import uuid
from typing import Any

import numpy as np

from metrale_jax.embedding.pooler import shortened
from metrale_jax.errors import ContextLengthError, InvalidParameterError
from serving.http.pooling_protocol import EmbeddingRequest, RerankRequest, ScoreRequest
from serving.http.state import ServerState

SERVES = {"embed": "embeddings (/v1/embeddings, and /v1/rerank and /v1/score by cosine "
                   "similarity)",
          "score": "scores of text pairs (/v1/rerank and /v1/score)"}
"""What a pooling model of each task answers, as the errors name it."""


class PoolingJob:
    """One pooling request as the access layer and the request dump see a `Generation`: the
    tokens it reserves (`token_budget`), its usage once done, no queue or first-token time."""

    def __init__(self, prompt_tokens: int):
        self.token_budget = prompt_tokens
        self.prompt_tokens = 0  # the tokens read, once answered
        self.queue_seconds: float | None = None
        self.first_token_at: float | None = None

    def submit(self) -> None:
        """Nothing to queue: the route runs the pooler itself."""

    def cancel(self) -> None:
        """Nothing to cancel: a pooler's batch is short and runs to its end."""

    def observe_end(self) -> None:
        """No per-token metrics to record."""

    def usage(self) -> dict[str, Any]:
        """The usage object: prompt tokens only."""
        return {"prompt_tokens": self.prompt_tokens, "total_tokens": self.prompt_tokens}


async def require_pooler(state: ServerState, model: str | None, task: str | None = None,
                         keep_alive: Any = None) -> Any:
    """The named model's pooler for a pooling route (`task` "embed": an embedding model,
    None: any pooling model), loaded on demand and held until the request ends; 400 naming
    what the model serves otherwise."""
    rt, _ = await state.use_model(model, keep_alive=keep_alive)
    name = rt.settings.model_name
    pooler = rt.pooler
    if pooler is None:
        raise InvalidParameterError(
            f"the model {name!r} generates text (/v1/chat/completions, /v1/completions); it "
            "is not an embedding or reranking model", param="model")
    if task is not None and pooler.info.task != task:
        raise InvalidParameterError(f"the model {name!r} serves {SERVES[pooler.info.task]}, "
                                    "not embeddings", param="model")
    return pooler


def truncate_limit(value: int | None, limit: int) -> int | None:
    """The length inputs are cut to for `truncate_prompt_tokens` (-1: the model's limit;
    None: no cutting); a value above the limit is a 400."""
    if value is None:
        return None
    if value == -1:
        return limit
    if value == 0 or value > limit:
        raise InvalidParameterError(f"truncate_prompt_tokens must be -1 or in [1, {limit}] "
                                    "(this model's longest input)",
                                    param="truncate_prompt_tokens")
    return value


def cut(ids: list[int], length: int, special: set[int]) -> list[int]:
    """`ids` cut to `length` tokens; a closing special token of `special` ([SEP], </s>,
    <|endoftext|>) stays last, as a tokenizer's own truncation keeps it."""
    if len(ids) <= length:
        return ids
    if ids[-1] in special and length >= 2:
        return ids[:length - 1] + ids[-1:]
    return ids[:length]


def embedding_inputs(pooler: Any, req: EmbeddingRequest) -> list[list[int]]:
    """The request's inputs as token ids, checked (vocabulary, length) or cut to fit."""
    tok, info = pooler.tokenizer, pooler.info
    limit = info.max_input_tokens
    length = truncate_limit(req.truncate_prompt_tokens, limit)
    closing = pooler.encode_text("")[-1:]  # [SEP], </s>, <|endoftext|>: kept when cutting
    out = []
    vocab = tok.vocab_size
    for i, item in enumerate(req.inputs()):
        if isinstance(item, str):
            ids = pooler.encode_text(item)
        else:
            ids = list(item)
            if max(ids) >= vocab:
                raise InvalidParameterError(f"input[{i}] holds a token id ≥ the vocabulary "
                                            f"size {vocab}", param="input")
        if length is not None:
            ids = cut(ids, length, set(closing) if isinstance(item, str) else set())
        elif len(ids) > limit:
            raise ContextLengthError(
                f"input[{i}] has {len(ids)} tokens, but this model embeds at most {limit}; "
                "shorten it, or send truncate_prompt_tokens=-1 to cut it", param="input")
        out.append(ids)
    return out


def encoded(vector: np.ndarray, encoding: str) -> list[float] | str:
    """One embedding as OpenAI sends it: floats, or base64 of its little-endian float32s."""
    if encoding == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
    return [float(x) for x in vector]


def _reserve(state: ServerState, tokens: int) -> PoolingJob:
    job = PoolingJob(tokens)
    state.access.submit(job)  # 429 when the key's limits cannot hold the tokens
    return job


def _done(state: ServerState, job: PoolingJob, tokens: int, started: float) -> None:
    job.prompt_tokens = tokens
    state.metrics.prompt_tokens.inc(tokens)
    state.metrics.request_success.labels(finished_reason="pooled").inc()
    state.metrics.e2e.observe(time.monotonic() - started)


async def embeddings(state: ServerState, req: EmbeddingRequest) -> dict[str, Any]:
    """POST /v1/embeddings: OpenAI's `CreateEmbeddingResponse`."""
    started = time.monotonic()
    pooler = await require_pooler(state, req.model, task="embed", keep_alive=req.keep_alive)
    inputs = embedding_inputs(pooler, req)
    tokens = sum(len(ids) for ids in inputs)
    job = _reserve(state, tokens)
    vectors = await asyncio.to_thread(pooler.embed_ids, inputs)
    vectors = shortened(np.asarray(vectors, np.float32), req.dimensions, pooler.info)
    _done(state, job, tokens, started)
    data = [{"object": "embedding", "index": i, "embedding": encoded(v, req.encoding_format)}
            for i, v in enumerate(vectors)]
    return {"object": "list", "data": data, "model": req.model or state.pool.primary.name,
            "usage": job.usage()}


def _check_truncate(value: int | None, pooler: Any) -> bool:
    """Whether pairs may be cut to fit (`truncate_prompt_tokens` -1 or the model's limit);
    a smaller value is a 400 (pairs are cut to the limit only)."""
    limit = pooler.info.max_input_tokens
    length = truncate_limit(value, limit)
    if length is not None and length != limit:
        raise InvalidParameterError(
            f"truncate_prompt_tokens={value}: pairs are cut to this model's limit only "
            f"(-1 or {limit})", param="truncate_prompt_tokens")
    return length is not None


def _estimate(pooler: Any, texts: list[str]) -> int:
    return sum(len(pooler.tokenizer.encode(t, add_special_tokens=False)) + 2 for t in texts)


async def rerank(state: ServerState, req: RerankRequest) -> dict[str, Any]:
    """POST /v1/rerank: the documents by relevance to the query (Jina's and Cohere's shape:
    `results` of `index`, `relevance_score` and, with `return_documents`, `document`)."""
    started = time.monotonic()
    pooler = await require_pooler(state, req.model, keep_alive=req.keep_alive)
    docs = req.texts()
    truncate = _check_truncate(req.truncate_prompt_tokens, pooler)
    job = _reserve(state, _estimate(pooler, [req.query] * len(docs) + docs))
    scores, tokens = await asyncio.to_thread(pooler.score_texts, req.query, docs, truncate)
    _done(state, job, int(tokens), started)
    order = sorted(range(len(docs)), key=lambda i: -float(scores[i]))
    if req.top_n is not None:
        order = order[:req.top_n]
    results = []
    for i in order:
        item: dict[str, Any] = {"index": i, "relevance_score": float(scores[i])}
        if req.return_documents:
            item["document"] = {"text": docs[i]}
        results.append(item)
    return {"id": f"rerank-{uuid.uuid4().hex}", "object": "list",
            "model": req.model or state.pool.primary.name, "results": results,
            "usage": {"prompt_tokens": job.prompt_tokens, "total_tokens": job.prompt_tokens}}


async def score(state: ServerState, req: ScoreRequest) -> dict[str, Any]:
    """POST /v1/score (vLLM's shape): one score per (text_1, text_2) pair, in order."""
    started = time.monotonic()
    pooler = await require_pooler(state, req.model, keep_alive=req.keep_alive)
    pairs = req.pairs()
    truncate = _check_truncate(req.truncate_prompt_tokens, pooler)
    job = _reserve(state, _estimate(pooler, [t for p in pairs for t in p]))
    by_query: dict[str, list[int]] = {}
    for i, (query, _) in enumerate(pairs):
        by_query.setdefault(query, []).append(i)
    scores = np.zeros(len(pairs), np.float32)
    total = 0

    def run() -> int:
        read = 0
        for query, indices in by_query.items():
            try:
                got, n = pooler.score_texts(query, [pairs[i][1] for i in indices], truncate)
            except ContextLengthError as e:  # name the pair, not the group's document
                e.param = "text_2"
                raise
            scores[indices] = got
            read += int(n)
        return read

    total = await asyncio.to_thread(run)
    _done(state, job, total, started)
    data = [{"index": i, "object": "score", "score": float(s)} for i, s in enumerate(scores)]
    return {"id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
            "model": req.model or state.pool.primary.name, "data": data,
            "usage": {"prompt_tokens": total, "total_tokens": total}}
