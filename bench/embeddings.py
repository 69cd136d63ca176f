"""Embeddings and reranking against sentence-transformers on torch CPU, in the same run.

    PYTHONPATH=$PWD python -m bench.embeddings [--rounds 5] [--batches 1,32,256]

Table 1: sentences per second of all-MiniLM-L6-v2 (`metrale pull all-minilm-l6-v2`) at
batch 1, 32 and 256, over sentences of mixed lengths (4 to ~120 words), through
`LLM.embed` (the encoder's bucketed programs, warmed up first) and
`SentenceTransformer.encode` (its own batching: sorted by length, padded per batch of the
same size), alternating, the median of `--rounds`. Both in float32 on the CPU threads
torch and XLA see; the last column checks the two agree (the worst cosine).
Table 2: reranking 100 documents for one query with a cross-encoder of the same
architecture (a 6-layer MiniLM `BertForSequenceClassification`: all-MiniLM-L6-v2's encoder
with a random one-label head, what ms-marco-MiniLM-L6 cross-encoders are), latency of
`LLM.score` against `CrossEncoder.predict` (batch 32, its default), the median of
`--rounds`, and the largest score difference.
"""

from __future__ import annotations

import argparse
import random
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

TEXT = ("the model reads every sentence once and writes a vector that places similar "
        "meanings near each other so that a search can find passages by what they say "
        "rather than by the exact words they use while a cross encoder reads the query and "
        "the passage together and scores how well one answers the other")
WORDS = TEXT.split()


def sentences(n: int, seed: int = 0) -> list[str]:
    """`n` sentences of 4 to ~120 words (most short, a few long), seeded."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        length = min(120, 4 + int(rng.expovariate(1 / 18)))
        out.append(" ".join(rng.choice(WORDS) for _ in range(length)).capitalize() + ".")
    return out


def median_seconds(fn: Callable[[], object], rounds: int) -> float:
    """Median seconds of `rounds` calls of `fn` (after one warm call)."""
    fn()
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def runners(ours, theirs, texts: list[str], batch: int) -> tuple[Callable, Callable]:
    """The two embedding calls timed at `batch`: one sentence per call at batch 1."""
    if batch == 1:
        return (lambda: np.concatenate([ours.embed([t]) for t in texts]),
                lambda: np.concatenate([theirs.encode([t], batch_size=1) for t in texts]))
    return (lambda: ours.embed(texts), lambda: theirs.encode(texts, batch_size=batch))


def embedding_table(folder: Path, batches: list[int], rounds: int) -> None:
    """Table 1 (see the module docstring)."""
    from sentence_transformers import SentenceTransformer

    from metrale_jax import LLM
    ours = LLM(str(folder), warmup=True)
    theirs = SentenceTransformer(str(folder), device="cpu")
    print("all-MiniLM-L6-v2, sentences/s (float32, CPU; median of", rounds, "rounds)")
    print("| batch | metrale sent/s | sentence-transformers sent/s | ratio | worst cosine |")
    print("|---:|---:|---:|---:|---:|")
    for batch in batches:
        texts = sentences(max(batch, 64 if batch == 1 else batch), seed=batch)
        run_ours, run_theirs = runners(ours, theirs, texts, batch)
        t_ours, t_theirs = [], []
        run_ours(), run_theirs()
        for _ in range(rounds):  # alternating: the machine's noise hits both alike
            t_ours.append(median_seconds(run_ours, 1))
            t_theirs.append(median_seconds(run_theirs, 1))
        a, b = run_ours(), run_theirs()
        cos = float(np.min(np.sum(a * b, axis=1) / np.linalg.norm(a, axis=1)
                           / np.linalg.norm(b, axis=1)))
        ours_rate = len(texts) / statistics.median(t_ours)
        theirs_rate = len(texts) / statistics.median(t_theirs)
        print(f"| {batch} | {ours_rate:.0f} | {theirs_rate:.0f} | "
              f"{ours_rate / theirs_rate:.2f}x | {cos:.7f} |")
    ours.close()


def cross_encoder_folder(minilm: Path, into: Path) -> Path:
    """A MiniLM cross-encoder folder: all-MiniLM-L6-v2's encoder under a seeded random
    one-label classification head, saved by transformers with the tokenizer."""
    import torch
    from transformers import BertForSequenceClassification

    torch.manual_seed(0)
    model = BertForSequenceClassification.from_pretrained(str(minilm), num_labels=1)
    model.save_pretrained(str(into))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(minilm / name, into / name)
    return into


def rerank_table(minilm: Path, rounds: int, documents: int = 100) -> None:
    """Table 2 (see the module docstring)."""
    from sentence_transformers import CrossEncoder

    from metrale_jax import LLM
    with tempfile.TemporaryDirectory() as tmp:
        folder = cross_encoder_folder(minilm, Path(tmp) / "cross-encoder")
        ours = LLM(str(folder), warmup=True)
        theirs = CrossEncoder(str(folder), device="cpu")
        query = "how does a search engine find passages by meaning"
        docs = sentences(documents, seed=7)

        def run_ours() -> np.ndarray:
            return ours.score(query, docs)

        def run_theirs() -> np.ndarray:
            return np.asarray(theirs.predict([(query, d) for d in docs]))
        t_ours, t_theirs = [], []
        run_ours(), run_theirs()
        for _ in range(rounds):
            t_ours.append(median_seconds(run_ours, 1))
            t_theirs.append(median_seconds(run_theirs, 1))
        diff = float(np.max(np.abs(run_ours() - run_theirs())))
        ours.close()
    a, b = statistics.median(t_ours), statistics.median(t_theirs)
    print(f"\nrerank {documents} documents for one query (MiniLM-L6 cross-encoder)")
    print("| metrale ms | sentence-transformers ms | speed-up | max score difference |")
    print("|---:|---:|---:|---:|")
    print(f"| {a * 1e3:.1f} | {b * 1e3:.1f} | {b / a:.2f}x | {diff:.2e} |")


def main() -> None:
    """Parses the flags and prints both tables."""
    from metrale_jax.weights.default_model import model_path, pull
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--batches", default="1,32,256")
    p.add_argument("--documents", type=int, default=100)
    args = p.parse_args()
    folder = model_path("all-minilm-l6-v2")
    if not folder.is_dir():
        folder = pull("all-minilm-l6-v2")
    embedding_table(folder, [int(b) for b in args.batches.split(",")], args.rounds)
    rerank_table(folder, args.rounds, args.documents)


if __name__ == "__main__":
    main()
