"""The encoder pooler on tiny random BERT / XLM-RoBERTa models against sentence-transformers
(float32): pooled vectors, cross-encoder scores, batch invariance, the length limit and
truncation, and a compile counter that stays flat after warmup.

The poolers use a tiny grid (lengths 16 and 32, at most 4 rows, 64 tokens a program) and
compile only the shapes their inputs need, except `warm_pooler`, which compiles its grid."""

from __future__ import annotations

import json
import shutil
import threading

import numpy as np
import pytest

from devtools.encoder_models import (
    build_bert_cross_encoder,
    build_bert_embedder,
    build_xlm_roberta,
)
from metrale_jax.embedding.encoder_pooler import is_encoder_folder, load_encoder_pooler
from metrale_jax.errors import ContextLengthError, InvalidParameterError
from metrale_jax.weights.encoder_reader import read_encoder_setup

GRID = dict(max_rows=4, token_budget=64, min_length=16)
TEXTS = [
    "the quick brown fox",
    "a dog",
    "rain in paris and london is not good weather for a walk at night",
    "i read a book",
    "coffee or tea?",
    "the cat and the dog eat fish by the river in the city, the bird is in the tree.",
    "search query",
]
QUERY = "good weather for a walk"


def _close(a: np.ndarray, b: np.ndarray, atol: float = 1e-5) -> None:
    """Rows of `a` and `b` agree within 1e-5 in cosine and absolutely."""
    cos = np.sum(a * b, 1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
    assert np.all(1 - cos < 1e-5), cos
    np.testing.assert_allclose(a, b, atol=atol, rtol=1e-5)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("encoders")
    return root


@pytest.fixture(scope="module")
def bert_folder(folders):
    return build_bert_embedder(folders / "bert_mean", "mean", normalize=True)


@pytest.fixture(scope="module")
def bert_pooler(bert_folder):
    pooler = load_encoder_pooler(bert_folder, **GRID)
    yield pooler
    pooler.close()


@pytest.fixture(scope="module")
def bert_st(bert_folder):
    from sentence_transformers import SentenceTransformer
    return SentenceTransformer(str(bert_folder), device="cpu")


@pytest.mark.parametrize("pooling", ["mean", "cls", "max", "lasttoken"])
@pytest.mark.parametrize("normalize", [True, False])
def test_vectors_match_sentence_transformers(folders, pooling, normalize):
    from sentence_transformers import SentenceTransformer
    folder = build_bert_embedder(folders / f"bert_{pooling}_{normalize}", pooling, normalize)
    pooler = load_encoder_pooler(folder, **GRID)
    try:
        assert pooler.info.pooling == {"lasttoken": "last"}.get(pooling, pooling)
        assert pooler.info.normalize is normalize
        assert (pooler.info.task, pooler.info.kind) == ("embed", "encoder")
        assert pooler.info.dimensions == 32 and pooler.info.max_input_tokens == 32
        ours = pooler.embed_ids([pooler.encode_text(t) for t in TEXTS])
    finally:
        pooler.close()
    ref = SentenceTransformer(str(folder), device="cpu").encode(TEXTS, convert_to_numpy=True)
    _close(ours, ref)
    if normalize:
        np.testing.assert_allclose(np.linalg.norm(ours, axis=1), 1, atol=1e-6)


def test_a_vector_does_not_depend_on_its_batch(bert_pooler):
    alone = np.stack([bert_pooler.embed_ids([bert_pooler.encode_text(t)])[0] for t in TEXTS])
    mixed = bert_pooler.embed_ids([bert_pooler.encode_text(t) for t in TEXTS * 2])
    np.testing.assert_allclose(mixed[:len(TEXTS)], alone, atol=1e-6, rtol=0)
    np.testing.assert_allclose(mixed[len(TEXTS):], alone, atol=1e-6, rtol=0)


def test_concurrent_callers_get_their_own_vectors(bert_pooler):
    want = bert_pooler.embed_ids([bert_pooler.encode_text(t) for t in TEXTS])
    got: dict[int, np.ndarray] = {}

    def call(i: int) -> None:
        got[i] = bert_pooler.embed_ids([bert_pooler.encode_text(TEXTS[i])])[0]

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(TEXTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    np.testing.assert_allclose(np.stack([got[i] for i in range(len(TEXTS))]), want, atol=1e-6)


def test_inputs_at_the_limit_work_and_one_over_is_refused(bert_pooler, bert_st):
    at_limit = "the " * 30  # [CLS] + 30 + [SEP] = 32 tokens, the limit
    over = "the " * 31
    ids = bert_pooler.encode_text(at_limit)
    assert len(ids) == 32 and len(bert_pooler.encode_text(over)) == 33
    _close(bert_pooler.embed_ids([ids]), bert_st.encode([at_limit]))
    with pytest.raises(ContextLengthError, match="input 2 has 33 tokens"):
        bert_pooler.embed_ids([ids, ids, bert_pooler.encode_text(over)])
    with pytest.raises(ContextLengthError, match="input 1 has 33 tokens"):
        bert_pooler.score_texts(QUERY, ["a dog", over])
    with pytest.raises(InvalidParameterError, match="input 1 has a token id outside"):
        bert_pooler.embed_ids([ids, [2, 256, 3]])
    with pytest.raises(InvalidParameterError, match="input 0 is empty"):
        bert_pooler.embed_ids([[]])


def test_embedding_scores_are_cosines_and_truncate_as_sentence_transformers(bert_pooler,
                                                                            bert_st):
    long_doc = "the cat and the dog eat fish " * 8
    docs = [*TEXTS, long_doc]
    scores, tokens = bert_pooler.score_texts(QUERY, docs, truncate=True)
    ref = bert_st.encode([QUERY, *docs])
    want = ref[1:] @ ref[0] / (np.linalg.norm(ref[1:], axis=1) * np.linalg.norm(ref[0]))
    np.testing.assert_allclose(scores, want, atol=1e-5)
    assert tokens == sum(min(len(bert_pooler.encode_text(t)), 32) for t in [QUERY, *docs])


def test_xlm_roberta_bare_folder_is_mean_pooled_like_sentence_transformers(folders):
    from sentence_transformers import SentenceTransformer
    folder = build_xlm_roberta(folders / "xlmr", max_length=40)
    pooler = load_encoder_pooler(folder, **GRID)
    try:
        info = pooler.info
        assert (info.pooling, info.normalize, info.max_input_tokens) == ("mean", False, 40)
        at_limit = "the " * 38
        texts = [*TEXTS, at_limit]
        ids = [pooler.encode_text(t) for t in texts]
        assert ids[0][0] == 0 and ids[0][-1] == 2 and len(ids[-1]) == 40
        ours = pooler.embed_ids(ids)
    finally:
        pooler.close()
    ref = SentenceTransformer(str(folder), device="cpu").encode(texts)
    _close(ours, ref)


@pytest.fixture(scope="module")
def cross_folder(folders):
    return build_bert_cross_encoder(folders / "cross", max_length=32)


def test_cross_encoder_scores_match_cross_encoder_predict(cross_folder):
    from sentence_transformers import CrossEncoder
    pooler = load_encoder_pooler(cross_folder, **GRID)
    long_doc = "rain in paris and london " * 6
    try:
        assert (pooler.info.task, pooler.info.kind, pooler.info.dimensions) == (
            "score", "cross-encoder", None)
        ids, types = pooler.encode_pair("a query", "a document")
        assert types == [0, 0, 0, 0, 1, 1, 1] and ids[0] == 2 and ids[3] == ids[-1] == 3
        scores, tokens = pooler.score_texts(QUERY, TEXTS)
        cut, _ = pooler.score_texts(QUERY, [long_doc, "a dog"], truncate=True)
        with pytest.raises(ContextLengthError, match="input 0 has"):
            pooler.score_texts(QUERY, [long_doc])
        with pytest.raises(Exception, match="cross-encoder"):
            pooler.embed_ids([ids])
    finally:
        pooler.close()
    ce = CrossEncoder(str(cross_folder), device="cpu")
    want = ce.predict([(QUERY, d) for d in TEXTS])
    np.testing.assert_allclose(scores, want, atol=1e-5)
    assert len(set(np.round(scores, 4))) > 3  # the scores tell the documents apart
    np.testing.assert_allclose(cut, ce.predict([(QUERY, long_doc), (QUERY, "a dog")]),
                               atol=1e-5)
    assert tokens > len(TEXTS) * 3


def test_xlm_roberta_cross_encoder_scores_match_cross_encoder_predict(folders):
    from sentence_transformers import CrossEncoder
    folder = build_xlm_roberta(folders / "xlmr_cross", classifier=True)
    pooler = load_encoder_pooler(folder, **GRID)
    try:
        ids, types = pooler.encode_pair("a query", "a document")
        assert ids[:4] == [0, 16, 138, 2] and ids[4:6] == [2, 16] and set(types) == {0}
        scores, _ = pooler.score_texts(QUERY, TEXTS)
    finally:
        pooler.close()
    want = CrossEncoder(str(folder), device="cpu").predict([(QUERY, d) for d in TEXTS])
    np.testing.assert_allclose(scores, want, atol=1e-5)


def test_compile_count_stays_flat_after_warmup(bert_folder):
    pooler = load_encoder_pooler(bert_folder, **GRID)
    try:
        pooler.warmup()
        compiled = pooler.compile_count
        assert compiled == len(pooler.grid.shapes())
        mixes = [TEXTS, TEXTS[:1], TEXTS * 3, ["the " * 30] * 5, [t[:5] for t in TEXTS]]
        for texts in mixes:
            pooler.embed_ids([pooler.encode_text(t) for t in texts])
        threads = [threading.Thread(target=pooler.score_texts, args=(QUERY, TEXTS[i:]))
                   for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert pooler.compile_count == compiled
    finally:
        pooler.close()
    with pytest.raises(RuntimeError, match="closed"):
        pooler.embed_ids([[2, 3]])


def test_reader_recognizes_folders_and_matryoshka(bert_folder, cross_folder, tmp_path):
    assert is_encoder_folder(bert_folder) and is_encoder_folder(cross_folder)
    assert not is_encoder_folder(tmp_path) and not is_encoder_folder(tmp_path / "missing")
    assert read_encoder_setup(bert_folder).matryoshka is False
    copy = tmp_path / "m"
    shutil.copytree(bert_folder, copy)
    path = copy / "config_sentence_transformers.json"
    raw = json.loads(path.read_text())
    path.write_text(json.dumps({**raw, "matryoshka_dimensions": [32, 16]}))
    assert read_encoder_setup(copy).matryoshka is True
    assert read_encoder_setup(copy).prompt == ""
    path.write_text(json.dumps({**raw, "default_prompt_name": "query",
                                "prompts": {"query": "query: ", "document": ""}}))
    assert read_encoder_setup(copy).prompt == "query: "
    assert read_encoder_setup(cross_folder).activation == "sigmoid"
    cross = tmp_path / "c"
    shutil.copytree(cross_folder, cross)
    raw = json.loads((cross / "config.json").read_text())
    raw["sentence_transformers"] = {"activation_fn": "torch.nn.modules.linear.Identity"}
    (cross / "config.json").write_text(json.dumps(raw))
    assert read_encoder_setup(cross).activation == "identity"
