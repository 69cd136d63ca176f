"""The pooling routes over real HTTP (Hypercorn on loopback) with the official `openai`
client: POST /v1/embeddings on a tiny random BERT embedder and on the real all-MiniLM-L6-v2
(`metrale pull all-minilm-l6-v2`; compared with sentence-transformers), POST /v1/rerank and
/v1/score on an embedder (cosine) and a tiny cross-encoder (compared with
`CrossEncoder.predict`), the 400s, keys and limits, dumps, metrics and the compile counter."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import time
import urllib.request

import numpy as np
import openai
import pytest

from metrale_jax.weights.default_model import model_path
from serving.http.dumps import dump_files, read_dump_lines
from tests.serving.conftest import MODEL, get_json, post, wait_healthy

EMBEDDER = "tiny-embedder"
CROSS = "tiny-cross-encoder"
SENTENCES = ["A cat sat on the warm mat by the door.", "Stocks fell sharply on Monday.",
             "the quick brown fox", "Rain is expected in the north tomorrow afternoon.",
             "He played the violin beautifully at the wedding reception last night.", "ok"]
NOON = 1_767_225_600.0 + 12 * 3600


ENCODER_GRID = {"max_rows": 8, "token_budget": 256}
"""A small program grid (rows 1 .. 8, at most 256 tokens a program): few compiles."""


def _serve(folder, name: str, max_len: int = 64, engine_options: dict | None = None,
           warmup: str = "full", **kw):
    from serving.http.server import ServerThread
    from serving.http.settings import ServerSettings
    settings = ServerSettings(model=str(folder), served_model_name=name, port=0, max_slots=8,
                              max_len=max_len, warmup=warmup,
                              engine_options=engine_options or ENCODER_GRID, **kw)
    srv = ServerThread(settings).start()
    assert srv.wait_ready(timeout=600), srv.state.runtime.error
    wait_healthy(srv.url)
    return srv


@pytest.fixture(scope="module")
def embedder_folder(tmp_path_factory):
    from devtools.encoder_models import build_bert_embedder
    return build_bert_embedder(tmp_path_factory.mktemp("embedder"), pooling="mean",
                               normalize=True, max_seq_length=60)


@pytest.fixture(scope="module")
def embedder(embedder_folder):
    srv = _serve(embedder_folder, EMBEDDER)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def cross_folder(tmp_path_factory):
    from devtools.encoder_models import build_bert_cross_encoder
    return build_bert_cross_encoder(tmp_path_factory.mktemp("cross"), max_length=60)


@pytest.fixture(scope="module")
def cross(cross_folder):
    srv = _serve(cross_folder, CROSS)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def minilm():
    folder = model_path("all-minilm-l6-v2")
    if not folder.is_dir():
        pytest.skip("all-MiniLM-L6-v2 is not pulled (`metrale pull all-minilm-l6-v2`)")
    srv = _serve(folder, "all-minilm")
    yield folder, srv
    srv.stop()


def _client(url: str, key: str = "none") -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0)


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.sum(a * b, axis=1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


def test_real_minilm_matches_sentence_transformers_over_the_openai_client(minilm, schemas):
    """all-MiniLM-L6-v2 through `client.embeddings.create`, float and base64 (the client's
    default, decoded by it), equal sentence-transformers' `encode` of the same folder within
    1e-5 cosine, batched or one at a time; usage counts the model's tokens."""
    from sentence_transformers import SentenceTransformer
    folder, srv = minilm
    texts = [*SENTENCES, "Embeddings place similar meanings near each other.",
             "Une phrase en français, pour voir.", "1234 5678 numbers and CAPITALS!",
             " ".join(["long"] * 40) + " sentence near the length of a paragraph."]
    reference = SentenceTransformer(str(folder), device="cpu").encode(texts)
    client = _client(srv.url)
    floats = client.embeddings.create(model="all-minilm", input=texts, encoding_format="float")
    b64 = client.embeddings.create(model="all-minilm", input=texts)  # base64 on the wire
    for answer in (floats, b64):
        got = np.array([d.embedding for d in answer.data], np.float32)
        assert got.shape == reference.shape
        assert np.all(_cosines(got, reference) > 1 - 1e-5)
        assert np.allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    alone = np.array([client.embeddings.create(model="all-minilm", input=t,
                                               encoding_format="float").data[0].embedding
                      for t in texts[:4]], np.float32)
    np.testing.assert_allclose(alone, np.array([d.embedding for d in floats.data[:4]]),
                               atol=1e-6)
    tokenizer = SentenceTransformer(str(folder), device="cpu").tokenizer
    assert floats.usage.prompt_tokens == sum(len(tokenizer(t)["input_ids"]) for t in texts)
    status, _, body = post(srv.url, "/v1/embeddings", {"model": "all-minilm", "input": texts})
    assert status == 200
    schemas.validate("CreateEmbeddingResponse", body)


def test_inputs_as_text_token_ids_or_lists_of_them_agree(embedder, schemas):
    """`input` as a string, strings, token ids and lists of token ids: the same vectors for
    the same tokens; base64 decodes to the float answer; the body validates."""
    url = embedder.url
    _, _, tokenized = post(url, "/tokenize", {"prompt": SENTENCES[0]})
    ids = tokenized["tokens"]
    one = post(url, "/v1/embeddings", {"input": SENTENCES[0]})[2]
    many = post(url, "/v1/embeddings", {"input": SENTENCES})[2]
    as_ids = post(url, "/v1/embeddings", {"input": ids})[2]
    as_lists = post(url, "/v1/embeddings", {"input": [ids, ids[:3]]})[2]
    b64 = post(url, "/v1/embeddings", {"input": SENTENCES, "encoding_format": "base64"})[2]
    for body in (one, many, as_ids, as_lists):
        schemas.validate("CreateEmbeddingResponse", body)
    vec = np.array(one["data"][0]["embedding"])
    np.testing.assert_allclose(vec, many["data"][0]["embedding"], atol=1e-6)
    np.testing.assert_allclose(vec, as_ids["data"][0]["embedding"], atol=1e-6)
    np.testing.assert_allclose(vec, as_lists["data"][0]["embedding"], atol=1e-6)
    assert as_lists["usage"]["prompt_tokens"] == len(ids) + 3
    for d, f in zip(b64["data"], many["data"], strict=True):
        decoded = np.frombuffer(base64.b64decode(d["embedding"]), "<f4")
        np.testing.assert_array_equal(decoded, np.float32(f["embedding"]))
    assert [d["index"] for d in many["data"]] == list(range(len(SENTENCES)))


def _error(url: str, path: str, body: dict, schemas, status: int = 400) -> dict:
    got, _, answer = post(url, path, body)
    assert got == status, answer
    schemas.error(answer)
    return answer["error"]


def test_bad_requests_are_400s_that_say_why(embedder, schemas):
    """Inputs over the limit name their index (or are cut with truncate_prompt_tokens), and
    every malformed field is a 400 naming it; a generation request says what the model
    serves."""
    url = embedder.url
    limit = get_json(url, "/v1/models")["data"][0]["max_model_len"]
    long_text = " ".join(["word"] * (limit + 10))
    err = _error(url, "/v1/embeddings", {"input": ["short", long_text]}, schemas)
    assert err["code"] == "context_length_exceeded" and "input[1]" in err["message"]
    cut = post(url, "/v1/embeddings", {"input": ["short", long_text],
                                       "truncate_prompt_tokens": -1})
    short = post(url, "/tokenize", {"prompt": "short"})[2]["count"]
    assert cut[0] == 200 and cut[2]["usage"]["prompt_tokens"] == limit + short
    _, _, tokens = post(url, "/tokenize", {"prompt": long_text})
    at_limit = tokens["tokens"][:limit - 1] + tokens["tokens"][-1:]  # [CLS] ... [SEP]
    same = post(url, "/v1/embeddings", {"input": at_limit})[2]["data"][0]["embedding"]
    np.testing.assert_allclose(cut[2]["data"][1]["embedding"], same, atol=1e-6)
    for body, param in (({"input": "x", "dimensions": 4}, "dimensions"),
                        ({"input": "x", "dimensions": 10_000}, "dimensions"),
                        ({"input": []}, "input"), ({"input": ""}, "input"),
                        ({"input": [10 ** 6]}, "input"), ({"input": [[-1]]}, "input"),
                        ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
                        ({"input": "x", "truncate_prompt_tokens": 10_000},
                         "truncate_prompt_tokens"),
                        ({}, "input")):
        assert _error(url, "/v1/embeddings", body, schemas)["param"] == param, body
    for path, body in (("/v1/chat/completions", {"messages": [{"role": "user",
                                                               "content": "hi"}]}),
                       ("/v1/completions", {"prompt": "hi"})):
        err = _error(url, path, body, schemas)
        assert "embedding" in err["message"] and "/v1/embeddings" in err["message"]
    assert _error(url, "/v1/embeddings", {"model": "other", "input": "x"}, schemas,
                  status=404)["code"] == "model_not_found"


def test_a_chat_model_refuses_embeddings(base_url, schemas):
    """An embedding request to a model that generates text: a 400 that says so."""
    err = _error(base_url, "/v1/embeddings", {"model": MODEL, "input": "hi"}, schemas)
    assert "generates text" in err["message"] and err["param"] == "model"
    assert _error(base_url, "/v1/rerank", {"query": "q", "documents": ["d"]},
                  schemas)["param"] == "model"


def test_an_embedder_reranks_and_scores_by_cosine(embedder, schemas):
    """/v1/rerank orders by the cosine of the embeddings (top_n, return_documents, documents
    as objects, the /rerank and /v2/rerank aliases); /v1/score pairs one text_1 with each
    text_2 or list with list; unequal lists are a 400."""
    url = embedder.url
    query, docs = "a cat on a mat", SENTENCES[1:]
    vectors = np.array([d["embedding"] for d in post(
        url, "/v1/embeddings", {"input": [query, *docs]})[2]["data"]])
    cos = _cosines(vectors[1:], np.repeat(vectors[:1], len(docs), 0))
    status, _, ranked = post(url, "/v1/rerank", {"query": query, "documents": docs})
    assert status == 200
    assert [r["index"] for r in ranked["results"]] == list(np.argsort(-cos, kind="stable"))
    np.testing.assert_allclose([r["relevance_score"] for r in ranked["results"]],
                               np.sort(cos)[::-1], atol=1e-5)
    assert ranked["results"][0]["document"]["text"] == docs[ranked["results"][0]["index"]]
    assert ranked["usage"]["total_tokens"] > 0
    for path in ("/rerank", "/v2/rerank"):
        short = post(url, path, {"query": query, "documents": [{"text": d} for d in docs],
                                 "top_n": 2, "return_documents": False})[2]
        assert short["results"] == [{k: v for k, v in r.items() if k != "document"}
                                    for r in ranked["results"][:2]]
    scored = post(url, "/v1/score", {"text_1": query, "text_2": docs})[2]
    assert [d["index"] for d in scored["data"]] == list(range(len(docs)))
    np.testing.assert_allclose([d["score"] for d in scored["data"]], cos, atol=1e-5)
    pairwise = post(url, "/v1/score", {"text_1": [query, docs[0]], "text_2": docs[:2]})[2]
    assert len(pairwise["data"]) == 2
    np.testing.assert_allclose(pairwise["data"][0]["score"], cos[0], atol=1e-5)
    assert _error(url, "/v1/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]},
                  schemas)["param"] == "text_2"
    assert _error(url, "/v1/rerank", {"query": "q", "documents": []},
                  schemas)["param"] == "documents"
    assert _error(url, "/v1/rerank", {"query": "q", "documents": ["d"], "top_n": 0},
                  schemas)["param"] == "top_n"


def test_a_cross_encoder_reranks_as_sentence_transformers_scores(cross, cross_folder, schemas):
    """A BertForSequenceClassification cross-encoder's /v1/rerank and /v1/score equal
    `CrossEncoder.predict` on the same pairs; it makes no embeddings (400); /v1/models
    says it scores."""
    from sentence_transformers import CrossEncoder
    url = cross.url
    query, docs = "a cat", SENTENCES
    expected = CrossEncoder(str(cross_folder), device="cpu").predict(
        [(query, d) for d in docs])
    ranked = post(url, "/v1/rerank", {"query": query, "documents": docs})[2]["results"]
    got = np.zeros(len(docs))
    for r in ranked:
        got[r["index"]] = r["relevance_score"]
    np.testing.assert_allclose(got, expected, atol=1e-5)
    scored = post(url, "/v1/score", {"text_1": query, "text_2": docs})[2]
    np.testing.assert_allclose([d["score"] for d in scored["data"]], expected, atol=1e-5)
    err = _error(url, "/v1/embeddings", {"input": "x"}, schemas)
    assert "/v1/rerank" in err["message"]
    card = get_json(url, "/v1/models")["data"][0]
    assert card["task"] == "score" and card["pooling"]["kind"] == "cross-encoder"
    too_long = " ".join(["word"] * 40)
    err = _error(url, "/v1/rerank", {"query": query, "documents": ["ok", too_long]}, schemas)
    assert err["code"] == "context_length_exceeded" and "1" in err["message"]
    assert post(url, "/v1/rerank", {"query": query, "documents": ["ok", too_long],
                                    "truncate_prompt_tokens": -1})[0] == 200


def test_models_card_says_what_an_embedder_serves(embedder):
    card = get_json(embedder.url, "/v1/models")["data"][0]
    assert card["id"] == EMBEDDER and card["task"] == "embedding"
    assert card["pooling"] == {"kind": "encoder", "dimensions": card["pooling"]["dimensions"],
                               "pooling": "mean", "normalize": True, "matryoshka": False}
    assert card["max_model_len"] == 60  # the folder's max_seq_length


def test_concurrent_requests_share_programs_and_compile_nothing(embedder):
    """Many requests at once, each with several inputs, get the vectors each gets alone, and
    the compile counter does not move after warmup."""
    url = embedder.url
    before = get_json(url, "/v1/metrale/stats")["compiles"]
    inputs = [[f"{s} {i}" for s in SENTENCES[: 1 + i % len(SENTENCES)]] for i in range(16)]
    alone = [np.array([d["embedding"] for d in post(url, "/v1/embeddings",
                                                    {"input": x})[2]["data"]])
             for x in inputs]

    async def together() -> list:
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        answers = await asyncio.gather(*(client.embeddings.create(
            model=EMBEDDER, input=x, encoding_format="float") for x in inputs))
        await client.close()
        return answers

    for answer, expected in zip(asyncio.run(together()), alone, strict=True):
        np.testing.assert_allclose([d.embedding for d in answer.data], expected, atol=1e-6)
    assert get_json(url, "/v1/metrale/stats")["compiles"] == before


KEYS = """
[[keys]]
key = "sk-small"
name = "small"
tenant = "search"
tokens_per_minute = 60
"""


def test_keys_limits_dumps_and_metrics_count_embeddings(embedder, tmp_path):
    """With keys: a request needs one, its tokens count against the key's per-minute limit
    (429 past it), its dump line has its route and usage, and the Prometheus prompt-token
    counter grows by its tokens."""
    from serving.http.server import ServerThread
    (tmp_path / "keys.toml").write_text(KEYS)
    settings = dataclasses.replace(embedder.settings, api_keys_file=str(tmp_path / "keys.toml"),
                                   dump_requests=str(tmp_path / "dumps"))
    srv = ServerThread(settings, runtime=embedder.state.runtime).start()
    try:
        assert srv.wait_ready(timeout=60)
        srv.state.access.limiter.clock = lambda: NOON  # the bucket never refills here
        auth = {"Authorization": "Bearer sk-small"}
        assert post(srv.url, "/v1/embeddings", {"input": "x"})[0] == 401

        def prompt_counter() -> float:
            req = urllib.request.Request(srv.url + "/metrics", headers=auth)
            with urllib.request.urlopen(req, timeout=30) as r:
                text = r.read().decode()
            return sum(float(line.split()[-1]) for line in text.splitlines()
                       if line.startswith("metrale:prompt_tokens_total"))

        counted = prompt_counter()
        status, headers, body = post(srv.url, "/v1/embeddings",
                                     {"input": SENTENCES[:2]}, auth)
        assert status == 200
        used = body["usage"]["prompt_tokens"]
        assert int(headers["x-ratelimit-remaining-tokens"]) == 60 - used
        assert prompt_counter() == counted + used
        status, _, err = post(srv.url, "/v1/embeddings",
                              {"input": ["word word word"] * 3}, auth)
        assert status == 429, err
        deadline = time.monotonic() + 30
        lines: list = []
        while time.monotonic() < deadline and len(lines) < 3:
            assert srv.state.dumper.flush()
            lines = [x for f in dump_files(tmp_path / "dumps") for x in read_dump_lines(f)]
        ok = [x for x in lines if x["status"] == 200]
        assert len(ok) == 1 and ok[0]["route"] == "/v1/embeddings"
        assert ok[0]["outcome"]["usage"]["prompt_tokens"] == used
        assert ok[0]["tenant"] == "search" and ok[0]["body"]["input"] == SENTENCES[:2]
        assert [x["status"] for x in lines].count(429) == 1
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def decoder_embedder(tmp_path_factory):
    from devtools.hf_models import build_decoder_embedder
    folder = build_decoder_embedder(tmp_path_factory.mktemp("decoder") / "tiny-embedder")
    srv = _serve(folder, "tiny-decoder-embedder", max_len=256, warmup="none",
                 engine_options={"max_prefill_len": 32, "min_prefill_bucket": 16,
                                 "page_size": 16, "max_prefill_batch": 2})
    yield folder, srv
    srv.stop()


def test_a_decoder_embedder_serves_through_the_ragged_steps(decoder_embedder, schemas):
    """A decoder folder with sentence-transformers' last-token Pooling (Qwen3-Embedding's
    layout) is served for embeddings from its files alone: the vectors equal
    sentence-transformers', inputs longer than a step's prompt budget included; it
    generates nothing; its pages are all free afterwards."""
    from sentence_transformers import SentenceTransformer
    folder, srv = decoder_embedder
    texts = ["The quick brown fox jumps over the lazy dog.", "short",
             "A longer input that the ragged steps split into several prompt pieces. " * 2]
    status, _, body = post(srv.url, "/v1/embeddings", {"input": texts})
    assert status == 200, body
    schemas.validate("CreateEmbeddingResponse", body)
    expected = SentenceTransformer(str(folder), device="cpu").encode(texts)
    got = np.array([d["embedding"] for d in body["data"]])
    assert body["usage"]["prompt_tokens"] > 32  # one input spans several steps
    np.testing.assert_allclose(got, expected, atol=1e-5)
    card = get_json(srv.url, "/v1/models")["data"][0]
    assert card["task"] == "embedding" and card["pooling"]["kind"] == "decoder-embedding"
    assert _error(srv.url, "/v1/chat/completions",
                  {"messages": [{"role": "user", "content": "hi"}]}, schemas)["param"] == "model"
    pages = srv.state.runtime.pooler.scheduler.engine.pages
    assert pages.free_pages == pages.usable_pages
