"""`metrale embed` in subprocesses, and the Python API it stands on (`LLM.embed`,
`LLM.score`): vectors equal sentence-transformers', scores sort the documents, a model
that generates text or a bad flag is exit 2 with one line."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from devtools.hf_models import build_tiny_checkpoint
from metrale_jax.weights.default_model import model_path
from tests.serving.conftest import run_main

TEXTS = ["a cat on the mat", "stock prices fell", "the cat sleeps"]


def metrale(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    return subprocess.run([sys.executable, "-m", "serving.cli", *args], capture_output=True,
                          text=True, timeout=300, env=env, input=stdin)


@pytest.fixture(scope="module")
def embedder(tmp_path_factory):
    from devtools.encoder_models import build_bert_embedder
    return build_bert_embedder(tmp_path_factory.mktemp("cli-embedder"), pooling="cls",
                               normalize=True, max_seq_length=32)


def test_embed_prints_vectors_and_scores(embedder, capsys, monkeypatch):
    """Vectors (one JSON array a line, from arguments in a subprocess, or from stdin) equal
    sentence-transformers'; `--query` prints each text's cosine to the query, best first."""
    from sentence_transformers import SentenceTransformer
    r = metrale("embed", "--model", str(embedder), *TEXTS)
    assert r.returncode == 0, r.stderr
    got = np.array([json.loads(line) for line in r.stdout.splitlines()])
    expected = SentenceTransformer(str(embedder), device="cpu").encode(TEXTS)
    np.testing.assert_allclose(got, expected, atol=1e-5)
    monkeypatch.setattr("sys.stdin", io.StringIO("\n".join(TEXTS) + "\n"))
    code, out, err = run_main(capsys, "embed", "--model", str(embedder), "--json")
    assert code == 0, err
    np.testing.assert_allclose(json.loads(out)["embeddings"], got, atol=1e-6)
    code, out, err = run_main(capsys, "embed", "--model", str(embedder), "--query", TEXTS[0],
                              "--json", *TEXTS[1:])
    assert code == 0, err
    rows = json.loads(out)
    cos = got[1:] @ got[0]
    assert [row["index"] for row in rows] == list(np.argsort(-cos, kind="stable"))
    np.testing.assert_allclose([row["score"] for row in rows], np.sort(cos)[::-1], atol=1e-5)


def test_embed_refuses_what_it_cannot_do(embedder, tmp_path, capsys):
    """A model that generates text, Matryoshka dimensions on a model not trained for them,
    and a text over the limit: exit 2 with one line (the same `main` the console script
    runs, here in process)."""
    tiny = build_tiny_checkpoint(tmp_path / "llama")
    cases = (("--model", str(tiny), "hi"),
             ("--model", str(embedder), "--dimensions", "4", "hi"),
             ("--model", str(embedder), " ".join(["word"] * 50)))
    capsys.readouterr()  # the checkpoint writer's progress bar
    for args in cases:
        code, _, err = run_main(capsys, "embed", *args)
        assert code == 2, (args, err)
        assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_python_api_embed_and_score(embedder):
    """`LLM(folder).embed` and `.score` on an embedding model (cosine); generation on it is
    refused."""
    from metrale_jax import LLM
    from metrale_jax.errors import InvalidParameterError
    with LLM(str(embedder)) as llm:
        vectors = llm.embed(TEXTS)
        assert vectors.shape[0] == 3 and np.allclose(np.linalg.norm(vectors, axis=1), 1)
        np.testing.assert_allclose(llm.score(TEXTS[0], TEXTS[1:]), vectors[1:] @ vectors[0],
                                   atol=1e-5)
        with pytest.raises(InvalidParameterError, match="embed"):
            llm.generate("hi")


def test_pull_of_the_folder_model_is_idempotent():
    """`metrale pull all-minilm-l6-v2` (pulled by `make test`) prints its folder and leaves it
    as it is."""
    folder = model_path("all-minilm-l6-v2")
    if not folder.is_dir():
        pytest.skip("all-MiniLM-L6-v2 is not pulled")
    before = (folder / "model.safetensors").stat().st_mtime_ns
    r = metrale("pull", "all-minilm-l6-v2")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str(folder)
    assert (folder / "model.safetensors").stat().st_mtime_ns == before
