"""Decoder embedders and rerankers: a decoder family's last hidden state through the
scheduler's ragged steps (`GenerationRequest.pooling`: prefill-only pieces whose rows and
pages are freed as soon as the step's output is read; nothing compiles per request).

Two kinds, told apart from the folder (`decoder_pooling_task`):
- "decoder-embedding" (Qwen3-Embedding): the text as the folder's tokenizer encodes it with
  its special tokens (Qwen3-Embedding's `tokenizer.json` appends `<|endoftext|>`), the final-
  normed hidden state of its last token (`pooling_mode_lasttoken`) or their mean over the
  input (`pooling_mode_mean_tokens`: its engine runs without the prefix cache, since a
  shared prefix's hidden states are not computed again), L2-normalized when the sentence-
  transformers modules list `Normalize`. CLS and max pooling are refused.
- "decoder-reranker" (Qwen3-Reranker): each (query, document) pair in Qwen3-Reranker's
  prompt, scored sigmoid(logit("yes") - logit("no")) at its last token: the two rows of the
  model's head applied on the host to the pooled hidden state.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from metrale_jax.embedding.pooler import Pooler, PoolerInfo, Task, cosine_scores
from metrale_jax.errors import (
    BusyError,
    CheckpointError,
    ContextLengthError,
    InvalidParameterError,
)

log = logging.getLogger(__name__)

RERANK_SYSTEM = ("Judge whether the Document meets the requirements based on the Query and "
                 "the Instruct provided. Note that the answer can only be \"yes\" or \"no\".")
RERANK_INSTRUCTION = ("Given a web search query, retrieve relevant passages that answer the "
                      "query")
RERANK_PREFIX = f"<|im_start|>system\n{RERANK_SYSTEM}<|im_end|>\n<|im_start|>user\n"
RERANK_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
"""Qwen3-Reranker's prompt around each pair (its model card's `format_instruction`)."""


def rerank_pair(query: str, document: str, instruction: str | None = None) -> str:
    """The user turn of one (query, document) pair in Qwen3-Reranker's format."""
    return (f"<Instruct>: {instruction or RERANK_INSTRUCTION}\n<Query>: {query}\n"
            f"<Document>: {document}")


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None


def _decoder_config(path: Path) -> dict[str, Any] | None:
    """The folder's config.json when a decoder family we serve reads it, else None."""
    from metrale_jax.families import family_of_hf
    config = path / "config.json"
    if not config.is_file():
        return None
    cfg = _read_json(config)
    family = family_of_hf(cfg.get("model_type"))
    if family is None or family.kind != "decoder":
        return None
    return cfg


@dataclasses.dataclass(frozen=True)
class SentencePooling:
    """A decoder embedder's sentence-transformers settings: pooling ("last" | "mean" |
    "cls" | "max"), normalize (a `Normalize` module follows), matryoshka (config.json's
    `is_matryoshka` or `matryoshka_dimensions`, as vLLM reads them)."""

    pooling: str
    normalize: bool
    matryoshka: bool


def read_sentence_pooling(path: Path) -> SentencePooling | None:
    """The folder's `modules.json` Pooling module and `Normalize`, or None without a
    Pooling module. Raises `CheckpointError` for a pooling config that cannot be read."""
    modules_file = path / "modules.json"
    if not modules_file.is_file():
        return None
    modules = _read_json(modules_file)
    pooling_dir = next((m.get("path", "") for m in modules
                        if str(m.get("type", "")).endswith("Pooling")), None)
    if pooling_dir is None:
        return None
    conf = _read_json(path / pooling_dir / "config.json")
    modes = [name for key, name in (("pooling_mode_lasttoken", "last"),
                                    ("pooling_mode_mean_tokens", "mean"),
                                    ("pooling_mode_cls_token", "cls"),
                                    ("pooling_mode_max_tokens", "max")) if conf.get(key)]
    if len(modes) != 1:
        raise CheckpointError(f"{path}: the Pooling module must set one pooling mode, not "
                              f"{modes or 'none'}")
    normalize = any(str(m.get("type", "")).endswith("Normalize") for m in modules)
    cfg = _read_json(path / "config.json") if (path / "config.json").is_file() else {}
    matryoshka = bool(cfg.get("is_matryoshka") or cfg.get("matryoshka_dimensions"))
    return SentencePooling(modes[0], normalize, matryoshka)


def decoder_pooling_task(path: str | Path) -> Task | None:
    """What a decoder folder serves as a pooling model: "embed" (a decoder family with a
    sentence-transformers `modules.json` Pooling module: Qwen3-Embedding), "score" (a
    decoder reranker scored from its "yes"/"no" logits: config.json with
    `classifier_from_token`, as vLLM's Qwen3-Reranker override sets beside
    `architectures: [*ForSequenceClassification]`, or a `*ForCausalLM` folder whose name
    contains "reranker": the folder's, or the repository's in a Hub cache path), or None
    (not a decoder, or a chat model). A converted `*ForSequenceClassification` folder
    without `classifier_from_token` (its own `score` head) is not read: None. `path`: a
    local folder."""
    path = Path(path)
    cfg = _decoder_config(path)
    if cfg is None:
        return None
    if cfg.get("classifier_from_token"):
        return "score"
    archs = [str(a) for a in cfg.get("architectures") or ()]
    if any(a.endswith("ForSequenceClassification") for a in archs):
        return None
    # The folder's name, or a Hub cache's `models--Org--Name/snapshots/<hash>`.
    names = [*path.resolve().parts[-3:], str(cfg.get("_name_or_path", ""))]
    if any("reranker" in name.lower() for name in names):
        return "score"
    if read_sentence_pooling(path) is not None:
        return "embed"
    return None


class DecoderPooler(Pooler):
    """A decoder embedder ("decoder-embedding") or reranker ("decoder-reranker") over a
    running `Scheduler` whose engine has `pooled_output` (see the module docstring).

    Args:
        scheduler: the `Scheduler` (its engine: `EngineConfig.pooled_output=True`).
        tokenizer: the model's `metrale_jax.text.Tokenizer`.
        kind: "decoder-embedding" or "decoder-reranker".
        normalize: embeddings L2-normalized; matryoshka: as `PoolerInfo`.
        pooling: an embedder's "last" (token) or "mean" (over the input; needs an engine
            without the prefix cache).
        yes_no: the reranker's ("yes", "no") token ids.
        window: the most requests one call keeps queued at once.
    """

    def __init__(self, scheduler: Any, tokenizer: Any, kind: str, *, normalize: bool = True,
                 matryoshka: bool = False, yes_no: tuple[int, int] | None = None,
                 window: int = 128, pooling: str = "last"):
        if kind not in ("decoder-embedding", "decoder-reranker"):
            raise InvalidParameterError(f"unknown decoder pooler kind {kind!r}", param="kind")
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        engine = scheduler.engine
        if not engine.config.pooled_output:
            raise InvalidParameterError("a decoder pooler needs an engine with "
                                        "pooled_output=True", param="pooled_output")
        max_input = engine.config.max_len - 1  # the validator keeps one for a first token
        scorer = kind == "decoder-reranker"
        if pooling not in ("last", "mean") or (pooling == "mean" and scorer):
            raise InvalidParameterError(f"a decoder {kind} does not pool by {pooling!r}",
                                        param="pooling")
        if pooling == "mean" and engine.config.prefix_cache:
            raise InvalidParameterError("mean pooling needs an engine without the prefix "
                                        "cache (prefix_cache=False)", param="prefix_cache")
        self.mean = pooling == "mean"
        self.info = PoolerInfo(
            task="score" if scorer else "embed", kind=kind,  # type: ignore[arg-type]
            max_input_tokens=max_input,
            dimensions=None if scorer else engine.model_config.hidden_size,
            matryoshka=matryoshka and not scorer, pooling=None if scorer else pooling,
            normalize=normalize and not scorer)
        self.window = max(1, min(window, scheduler.max_waiting))
        self._head: np.ndarray | None = None
        if scorer:
            if yes_no is None:
                raise InvalidParameterError("a decoder reranker needs its yes/no token ids",
                                            param="yes_no")
            self._head = head_rows(engine, yes_no)
            self._prefix = tokenizer.encode(RERANK_PREFIX, add_special_tokens=False)
            self._suffix = tokenizer.encode(RERANK_SUFFIX, add_special_tokens=False)
        self._closed = False

    # ---- the contract --------------------------------------------------------------------
    def encode_text(self, text: str) -> list[int]:
        """`text`'s ids with the tokenizer's special tokens (Qwen3-Embedding's files append
        `<|endoftext|>`); for a reranker, the ids of a lone document's prompt."""
        if self.info.kind == "decoder-reranker":
            return self.pair_ids("", text)
        return list(self.tokenizer.encode(text, add_special_tokens=True))

    def pair_ids(self, query: str, document: str, truncate: bool = False) -> list[int]:
        """A (query, document) pair as the reranker reads it: Qwen3-Reranker's system
        prefix, the pair's user turn, the assistant's empty think block; with `truncate`
        the pair's own ids are cut to fit `max_input_tokens`."""
        pair = self.tokenizer.encode(rerank_pair(query, document), add_special_tokens=False)
        if truncate:
            pair = pair[:max(1, self.info.max_input_tokens - len(self._prefix)
                             - len(self._suffix))]
        return [*self._prefix, *pair, *self._suffix]

    def truncated(self, ids: list[int]) -> list[int]:
        """`ids` cut to `max_input_tokens`, keeping a trailing special token (the end token
        whose hidden state the embedder pools)."""
        limit = self.info.max_input_tokens
        if len(ids) <= limit:
            return ids
        if ids[-1] in self.tokenizer.special_ids:
            return [*ids[:limit - 1], ids[-1]]
        return ids[:limit]

    def embed_ids(self, inputs: Sequence[Sequence[int]]) -> np.ndarray:
        """Embeddings `[N, E] float32` of N token-id lists (the last token's final-normed
        hidden state, or their mean, as `info.pooling` says; normalized as `info` says).
        Raises `ContextLengthError` naming the index of an input over `max_input_tokens`;
        raises for a reranker."""
        if self.info.task != "embed":
            raise InvalidParameterError("this model scores (query, document) pairs; it "
                                        "serves no embeddings", param="input")
        vectors = self.pooled(inputs)
        if self.info.normalize:
            norms = np.linalg.norm(vectors, axis=1, keepdims=True)
            vectors = vectors / np.maximum(norms, 1e-12)
        return vectors.astype(np.float32)

    def score_texts(self, query: str, documents: Sequence[str],
                    truncate: bool = False) -> tuple[np.ndarray, int]:
        """Relevance `[N] float32` of each document to `query` and the tokens read: a
        reranker's P(yes) = sigmoid(logit(yes) - logit(no)); an embedder's cosine
        similarity of the query's and each document's vectors."""
        if self.info.kind == "decoder-embedding":
            ids = [self.encode_text(t) for t in (query, *documents)]
            if truncate:
                ids = [self.truncated(x) for x in ids]
            vectors = self.embed_ids(ids)
            return cosine_scores(vectors[0], vectors[1:]), sum(len(x) for x in ids)
        ids = [self.pair_ids(query, d, truncate) for d in documents]
        hidden = self.pooled(ids)
        diff = _yes_minus_no(hidden, self._head, self.scheduler.engine.model_config)
        scores = 1.0 / (1.0 + np.exp(-diff.astype(np.float64)))
        return scores.astype(np.float32), sum(len(x) for x in ids)

    @property
    def compile_count(self) -> int:
        """The engine's programs compiled so far (flat after warmup)."""
        return self.scheduler.engine.compile_count

    def warmup(self) -> None:
        """Compiles every program of the engine's grid (after the scheduler's own warmup;
        the programs it compiled already are found in its cache)."""
        if not self.scheduler.wait_ready():
            raise self.scheduler.startup_error
        self.scheduler.engine.warmup()

    def close(self) -> None:
        """Stops the scheduler; later calls raise."""
        self._closed = True
        self.scheduler.stop()

    # ---- the requests --------------------------------------------------------------------
    def pooled(self, inputs: Sequence[Sequence[int]]) -> np.ndarray:
        """The final-normed last hidden state `[N, E] float32` of each input (their mean
        over the input for a mean-pooling embedder), through the
        scheduler as pooling requests (at most `window` queued at once). Raises
        `ContextLengthError` naming the first input over `max_input_tokens`."""
        from metrale_jax.scheduler import GenerationRequest, Pooled, SamplingParams
        if self._closed:
            raise InvalidParameterError("this pooler is closed", param="model")
        limit = self.info.max_input_tokens
        for i, ids in enumerate(inputs):
            if not 1 <= len(ids) <= limit:
                if not ids:
                    raise InvalidParameterError(f"input {i} is empty", param="input")
                raise ContextLengthError(
                    f"input {i} has {len(ids)} tokens, but this model reads at most {limit}",
                    param="input")
        params = SamplingParams(max_tokens=1, temperature=0.0)
        out = np.zeros((len(inputs), self.scheduler.engine.model_config.hidden_size),
                       np.float32)
        queued: collections.deque = collections.deque()

        def take() -> None:
            i, handle = queued.popleft()
            end = None
            for event in handle:
                end = event
            if not isinstance(end, Pooled):
                for _, other in queued:
                    other.cancel()
                error = getattr(end, "error", None)
                if error is not None:
                    raise error
                raise InvalidParameterError(f"input {i} ended without a vector ({end!r})",
                                            param="input")
            out[i] = end.mean if self.mean else end.vector

        for i, ids in enumerate(inputs):
            if len(queued) >= self.window:
                take()
            request = GenerationRequest.make(ids, params, pooling=True)
            while True:
                try:
                    queued.append((i, self.scheduler.submit(request)))
                    break
                except BusyError:  # other callers filled the queue: wait for one of ours
                    if not queued:
                        raise
                    take()
        while queued:
            take()
        return out


def _yes_minus_no(hidden: np.ndarray, head: np.ndarray, cfg: Any) -> np.ndarray:
    """logit(yes) - logit(no) `[N]` from hidden `[N, E]` and the two head rows `[E, 2]`,
    with the model's final soft-cap."""
    logits = hidden.astype(np.float64) @ head.astype(np.float64)
    cap = getattr(cfg, "final_logit_softcap", None)
    if cap:
        logits = cap * np.tanh(logits / cap)
    return logits[:, 0] - logits[:, 1]


def head_rows(engine: Any, ids: tuple[int, int]) -> np.ndarray:
    """The model head's columns for token `ids` `[E, 2] float32`: the LM head's (or the tied
    embedding's) rows, dequantized with their scales when int8."""
    cfg, outer = engine.model_config, engine.params.outer
    idx = np.asarray(ids)
    if cfg.tie_word_embeddings:
        w = np.asarray(outer["embed"][...])[idx].T.astype(np.float32)
        scale = outer["embed_scale"][...] if "embed_scale" in outer else None
    else:
        w = np.asarray(outer["lm_head"][...])[:, idx].astype(np.float32)
        scale = outer["lm_head_scale"][...] if "lm_head_scale" in outer else None
    if scale is not None:
        w = w * np.asarray(scale, np.float32)[idx][None, :]
    return w


def load_decoder_pooler(path: str | Path, task: Task | None = None, *, dtype: str = "float32",
                        warmup: bool | str = True, **engine_options: Any) -> DecoderPooler:
    """Loads a decoder folder as a pooling model: `task` "embed" or "score" (None: as
    `decoder_pooling_task` says); `engine_options` go to `EngineConfig` (with
    `pooled_output=True`); `warmup` to the `Scheduler`. Returns a `DecoderPooler` whose
    scheduler is ready (`close()` stops it)."""
    from metrale_jax.engine import Engine
    from metrale_jax.engine.config import EngineConfig
    from metrale_jax.engine.placement import PlacementHook
    from metrale_jax.scheduler import Scheduler
    from metrale_jax.weights.checkpoint import load_checkpoint
    path = Path(path)
    task = task or decoder_pooling_task(path)
    if task not in ("embed", "score"):
        raise InvalidParameterError(f"{path} is no decoder embedding or reranker model",
                                    param="model")
    settings = read_sentence_pooling(path) if task == "embed" else None
    pooling = settings.pooling if settings is not None else "last"
    if pooling not in ("last", "mean"):
        raise InvalidParameterError(f"{path}: {pooling} pooling of a decoder embedder is not "
                                    "supported (last token or mean)", param="model")
    if pooling == "mean":  # a shared prefix's hidden states are not computed again
        engine_options = {**engine_options, "prefix_cache": False}
    cfg = _decoder_config(path) or {}
    hook = PlacementHook(EngineConfig(pooled_output=True, **engine_options))
    ckpt = load_checkpoint(path, dtype, shardings=hook,
                           quantization=engine_options.get("quantization"))
    engine = Engine(ckpt.config, ckpt.graphdef, ckpt.params, placement=hook.placement)
    tokenizer = ckpt.tokenizer
    yes_no = None
    if task == "score":
        yes, no = _classifier_tokens(cfg)
        yes_no = (tokenizer.token_to_id(yes), tokenizer.token_to_id(no))
        if None in yes_no:
            raise CheckpointError(f"{path}: the tokenizer has no single token for {yes!r} "
                                  f"and {no!r} (the reranker's answers)")
    scheduler = Scheduler(engine, tokenizer, tuple(tokenizer.eos_token_ids), warmup=warmup)
    if not scheduler.wait_ready():
        raise scheduler.startup_error
    kind = "decoder-reranker" if task == "score" else "decoder-embedding"
    return DecoderPooler(scheduler, tokenizer, kind,
                         normalize=settings.normalize if settings else True,
                         matryoshka=bool(settings and settings.matryoshka), yes_no=yes_no,
                         pooling=pooling)


def _classifier_tokens(cfg: dict[str, Any]) -> tuple[str, str]:
    """The reranker's ("yes", "no") answer tokens: config.json's `classifier_from_token`
    (vLLM's order: [no, yes]) or Qwen3-Reranker's."""
    tokens = cfg.get("classifier_from_token")
    if isinstance(tokens, list) and len(tokens) == 2:
        return str(tokens[1]), str(tokens[0])
    return "yes", "no"


__all__ = ["DecoderPooler", "SentencePooling", "decoder_pooling_task", "head_rows",
           "load_decoder_pooler", "read_sentence_pooling", "rerank_pair"]
