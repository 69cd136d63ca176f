"""Decoder embedders (Qwen3-Embedding style) and rerankers (Qwen3-Reranker style) through the
scheduler's ragged steps, against transformers and sentence-transformers in float32."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from devtools.hf_models import build_decoder_embedder, build_decoder_reranker
from metrale_jax.embedding.decoder_pooler import (
    decoder_pooling_task,
    load_decoder_pooler,
    read_sentence_pooling,
)
from metrale_jax.errors import ContextLengthError, InvalidParameterError

ENGINE = dict(max_slots=2, max_len=256, min_prefill_bucket=16, max_prefill_len=64,
              page_size=16, max_prefill_batch=2)
"""A step carries at most 64 prompt tokens: a longer input is split across steps."""
RERANK_ENGINE = {**ENGINE, "max_len": 512}
"""Qwen3-Reranker's prompt takes about 300 tokens of the tiny vocabulary."""

TEXTS = ["The quick brown fox jumps over the lazy dog.", "def main():",
         "Metrale serves language models on JAX and XLA. " * 4,
         "数字 1234567890 and symbols", "Ça va très bien, merci. " * 8, "a"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("decoder_pooling")
    return build_decoder_embedder(root / "tiny-embedder"), build_decoder_reranker(
        root / "tiny-reranker")


@pytest.fixture(scope="module")
def embedder(folders):
    pooler = load_decoder_pooler(folders[0], **ENGINE)
    yield pooler
    pooler.close()


@pytest.fixture(scope="module")
def reranker(folders):
    pooler = load_decoder_pooler(folders[1], **RERANK_ENGINE)
    yield pooler
    pooler.close()


@pytest.fixture(scope="module")
def mean_embedder(tmp_path_factory):
    folder = build_decoder_embedder(tmp_path_factory.mktemp("mean") / "tiny-mean-embedder",
                                    pooling="mean_tokens", seed=1)
    pooler = load_decoder_pooler(folder, **ENGINE)
    yield pooler, folder
    pooler.close()


def _all_free(pooler) -> bool:
    pages = pooler.scheduler.engine.pages
    return (pages.free_pages == pages.usable_pages
            and not any(pooler.scheduler.snapshot()["slots"]))


def test_detection_from_the_folders(folders, tmp_path):
    emb, rer = folders
    assert decoder_pooling_task(emb) == "embed"
    assert decoder_pooling_task(rer) == "score"
    assert read_sentence_pooling(emb).pooling == "last"
    chat = tmp_path / "chat"
    chat.mkdir()
    shutil.copy(rer / "config.json", chat / "config.json")
    assert decoder_pooling_task(chat) is None  # a decoder with neither: a chat model
    cfg = json.loads((chat / "config.json").read_text())
    (chat / "config.json").write_text(json.dumps(
        {**cfg, "architectures": ["Qwen3ForSequenceClassification"],
         "classifier_from_token": ["no", "yes"]}))
    assert decoder_pooling_task(chat) == "score"  # vLLM's Qwen3-Reranker override
    (chat / "config.json").write_text(json.dumps({"model_type": "bert"}))
    assert decoder_pooling_task(chat) is None


def test_embeddings_equal_transformers(embedder, folders):
    from sentence_transformers import SentenceTransformer
    from transformers import AutoModel
    info = embedder.info
    assert (info.task, info.kind, info.pooling, info.normalize) == (
        "embed", "decoder-embedding", "last", True)
    assert info.dimensions == 64 and info.max_input_tokens == ENGINE["max_len"] - 1
    ids = [embedder.encode_text(t) for t in TEXTS]
    assert all(x[-1] == embedder.tokenizer.eos_token_id for x in ids)  # the end token
    assert max(map(len, ids)) > ENGINE["max_prefill_len"]  # one spans several steps
    got = embedder.embed_ids(ids)
    model = AutoModel.from_pretrained(folders[0], torch_dtype=torch.float32).eval()
    with torch.no_grad():
        want = np.stack([model(torch.tensor([x])).last_hidden_state[0, -1].numpy()
                         for x in ids])
    want /= np.linalg.norm(want, axis=1, keepdims=True)
    np.testing.assert_allclose(got, want, atol=1e-5)
    st = SentenceTransformer(str(folders[0]), device="cpu").encode(TEXTS)
    np.testing.assert_allclose(got, st, atol=1e-5)
    assert _all_free(embedder)


def test_batch_invariance_flat_compiles_and_free_pages(embedder):
    warm = embedder.compile_count
    assert warm > 0
    embedder.warmup()  # the scheduler compiled the grid already
    assert embedder.compile_count == warm
    long_ids = embedder.encode_text(TEXTS[4] * 2)
    assert len(long_ids) > 2 * ENGINE["max_prefill_len"]
    alone = embedder.embed_ids([long_ids])[0]
    short = embedder.embed_ids([embedder.encode_text(TEXTS[1])])[0]
    mixed = [embedder.encode_text(t) for t in TEXTS * 3] + [long_ids]
    many = embedder.embed_ids(mixed)
    np.testing.assert_allclose(many[-1], alone, atol=1e-6)
    np.testing.assert_allclose(many[1], short, atol=1e-6)
    np.testing.assert_allclose(many[1 + len(TEXTS)], short, atol=1e-6)
    scores, tokens = embedder.score_texts(TEXTS[0], TEXTS[:3])
    assert tokens == sum(len(embedder.encode_text(t)) for t in (TEXTS[0], *TEXTS[:3]))
    assert scores[0] == pytest.approx(1.0, abs=1e-5) and scores.shape == (3,)
    assert embedder.compile_count == warm
    assert _all_free(embedder)


def test_inputs_at_and_over_the_context_limit(embedder):
    limit = embedder.info.max_input_tokens
    at = ([5] * limit)
    vec = embedder.embed_ids([[7, 8], at])
    assert vec.shape == (2, 64) and np.isfinite(vec).all()
    with pytest.raises(ContextLengthError, match="input 1 "):
        embedder.embed_ids([[7, 8], [5] * (limit + 1)])
    with pytest.raises(ContextLengthError, match="input 0 "):
        embedder.score_texts("x " * 400, ["a"])
    scores, _ = embedder.score_texts("x " * 400, ["a"], truncate=True)
    assert scores.shape == (1,)
    cut = embedder.truncated(embedder.encode_text("x " * 400))
    assert len(cut) == limit and cut[-1] == embedder.tokenizer.eos_token_id
    assert _all_free(embedder)


def test_reranker_scores_equal_transformers(reranker, folders):
    from transformers import AutoModelForCausalLM
    info = reranker.info
    assert (info.task, info.kind, info.dimensions) == ("score", "decoder-reranker", None)
    warm = reranker.compile_count
    query = "Which fox is quick?"
    docs = TEXTS[:4]
    scores, tokens = reranker.score_texts(query, docs)
    ids = [reranker.pair_ids(query, d) for d in docs]
    assert tokens == sum(map(len, ids))
    tok = reranker.tokenizer
    yes, no = tok.token_to_id("yes"), tok.token_to_id("no")
    model = AutoModelForCausalLM.from_pretrained(folders[1], torch_dtype=torch.float32).eval()
    with torch.no_grad():
        want = []
        for x in ids:
            logits = model(torch.tensor([x])).logits[0, -1].double()
            want.append(torch.sigmoid(logits[yes] - logits[no]).item())
    np.testing.assert_allclose(scores, want, atol=1e-5)
    again, _ = reranker.score_texts(query, [docs[2]])
    np.testing.assert_allclose(again[0], scores[2], atol=1e-6)
    with pytest.raises(InvalidParameterError):
        reranker.embed_ids([[1, 2]])
    with pytest.raises(ContextLengthError, match="input 1 "):
        reranker.score_texts(query, ["short", "long " * 600])
    cut, _ = reranker.score_texts(query, ["short", "long " * 600], truncate=True)
    assert cut.shape == (2,) and ((cut >= 0) & (cut <= 1)).all()
    assert reranker.compile_count == warm
    assert _all_free(reranker)


def test_pooling_requests_beside_generation_timeouts_and_usage(embedder):
    from metrale_jax.scheduler import (
        Finished,
        GenerationRequest,
        Pooled,
        SamplingParams,
        TimedOut,
    )
    sched = embedder.scheduler
    warm = embedder.compile_count
    ids = embedder.encode_text(TEXTS[2])
    alone = embedder.embed_ids([ids])[0]
    chat = sched.submit(GenerationRequest.make(
        embedder.encode_text(TEXTS[0]), SamplingParams(max_tokens=3, ignore_eos=True)))
    pooled = [sched.submit(GenerationRequest.make(ids, SamplingParams(max_tokens=1),
                                                  tenant=f"t{i}", pooling=True))
              for i in range(3)]
    late = sched.submit(GenerationRequest.make(ids, SamplingParams(max_tokens=1),
                                               timeout=-1.0, pooling=True))
    ends = [list(h)[-1] for h in pooled]
    for end in ends:
        assert isinstance(end, Pooled) and end.prompt_tokens == len(ids)
        np.testing.assert_allclose(end.vector / np.linalg.norm(end.vector), alone, atol=1e-6)
    chat_events = list(chat)
    assert isinstance(chat_events[-1], Finished) and chat_events[-1].completion_tokens == 3
    assert sum(len(e.token_ids) for e in chat_events[:-1]) == 3  # tokens streamed only here
    assert [type(e) for e in late] == [TimedOut]
    assert embedder.compile_count == warm
    assert _all_free(embedder)


def test_head_rows_tied_untied_and_int8():
    from types import SimpleNamespace

    from metrale_jax.embedding.decoder_pooler import head_rows
    rng = np.random.default_rng(0)
    embed = rng.normal(size=(10, 4)).astype(np.float32)  # [V, E]
    lm_head = rng.normal(size=(4, 10)).astype(np.float32)  # [E, V]
    scale = rng.uniform(0.5, 2, size=10).astype(np.float32)

    def engine(tied, **outer):
        return SimpleNamespace(model_config=SimpleNamespace(tie_word_embeddings=tied),
                               params=SimpleNamespace(outer=outer))

    np.testing.assert_array_equal(head_rows(engine(True, embed=embed), (3, 7)),
                                  embed[[3, 7]].T)
    np.testing.assert_array_equal(head_rows(engine(False, embed=embed, lm_head=lm_head),
                                            (3, 7)), lm_head[:, [3, 7]])
    np.testing.assert_allclose(
        head_rows(engine(False, lm_head=lm_head, lm_head_scale=scale), (3, 7)),
        lm_head[:, [3, 7]] * scale[[3, 7]], rtol=1e-6)


def test_mean_pooling_equals_sentence_transformers(mean_embedder):
    from sentence_transformers import SentenceTransformer
    pooler, folder = mean_embedder
    assert pooler.info.pooling == "mean"
    assert pooler.scheduler.engine.pages.cache is None  # no shared prefix: every state
    ids = [pooler.encode_text(t) for t in TEXTS]
    got = pooler.embed_ids(ids)
    st = SentenceTransformer(str(folder), device="cpu").encode(TEXTS)
    np.testing.assert_allclose(got, st, atol=1e-5)
    warm = pooler.compile_count
    many = pooler.embed_ids(ids[::-1] * 2)
    np.testing.assert_allclose(many[:len(ids)], got[::-1], atol=1e-6)
    assert pooler.compile_count == warm
    assert _all_free(pooler)


def test_pooling_requests_need_a_pooled_engine_and_sample_nothing():
    from types import SimpleNamespace

    from metrale_jax.scheduler import GenerationRequest, SamplingParams
    from metrale_jax.scheduler.validation import RequestValidator

    def check(pooled_output: bool, **params) -> None:
        engine = SimpleNamespace(config=SimpleNamespace(
            max_slots=4, max_len=64, pooled_output=pooled_output))
        validator = RequestValidator(engine, None, (), None, None)
        validator.check_pooling(GenerationRequest.make(
            [1, 2], SamplingParams(max_tokens=1, **params), pooling=True))

    check(True)
    with pytest.raises(InvalidParameterError, match="pooled_output"):
        check(False)
    with pytest.raises(InvalidParameterError, match="no beams"):
        check(True, num_beams=2)
