"""`metrale embed`: embeddings or relevance scores from an embedding model, a cross-encoder
or a decoder reranker, in this process (`metrale_jax.LLM.embed` / `.score`).

    metrale embed --model all-minilm-l6-v2 "first text" "second text"   # one JSON vector a line
    metrale embed --model all-minilm-l6-v2 --query "what is a cat" doc1 doc2
                                                   # score<TAB>document, best first
Texts come from the arguments, or one per line from stdin when none are given.
"""

from __future__ import annotations

import argparse
import json
import sys

from metrale_jax.errors import InvalidParameterError


def _texts(args: argparse.Namespace) -> list[str]:
    texts = list(args.texts)
    if not texts and not sys.stdin.isatty():
        texts = [line.rstrip("\n") for line in sys.stdin if line.strip()]
    if not texts:
        raise InvalidParameterError("give the texts as arguments or one per line on stdin",
                                    param="texts")
    return texts


def cmd_embed(args: argparse.Namespace) -> int:
    """Prints each text's embedding (one JSON array a line), or with `--query` each text's
    relevance to the query, best first."""
    import numpy as np

    from metrale_jax import LLM
    texts = _texts(args)
    llm = LLM(args.model, dtype=args.dtype, task=args.task)
    try:
        if llm.pooler is None:
            raise InvalidParameterError(
                f"{args.model!r} generates text; `metrale embed` needs an embedding or "
                "reranking model (or --task embed / --task score for a decoder one)",
                param="model")
        if args.query is not None:
            scores = llm.score(args.query, texts, truncate=args.truncate)
            order = np.argsort(-scores, kind="stable")
            if args.json:
                print(json.dumps([{"index": int(i), "score": float(scores[i]),
                                   "text": texts[i]} for i in order]))
            else:
                for i in order:
                    print(f"{scores[i]:.6f}\t{texts[i]}")
            return 0
        vectors = llm.embed(texts, dimensions=args.dimensions)
        if args.json:
            print(json.dumps({"model": args.model, "embeddings": vectors.tolist()}))
        else:
            for v in vectors:
                print(json.dumps([round(float(x), 7) for x in v]))
        return 0
    finally:
        llm.close()


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Registers `metrale embed`."""
    p = sub.add_parser("embed", help="embeddings, or relevance scores to a --query, from an "
                       "embedding model or a reranker")
    p.add_argument("texts", nargs="*", help="the texts (none: one per line from stdin)")
    p.add_argument("--model", default="all-minilm-l6-v2",
                   help="an embedding model, cross-encoder or reranker: a name `metrale "
                   "pull` knows, a folder, or a Hub name (default: %(default)s)")
    p.add_argument("--query", default=None,
                   help="score each text's relevance to this query instead (best first)")
    p.add_argument("--task", choices=["auto", "embed", "score"], default="auto",
                   help="auto: from the model's files; embed / score: a decoder model as an "
                   "embedding model or a yes/no reranker")
    p.add_argument("--dimensions", type=int, default=None,
                   help="keep the first N dimensions (Matryoshka models only)")
    p.add_argument("--truncate", action="store_true",
                   help="cut query-text pairs longer than the model's limit instead of "
                   "failing")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                   help="params and compute dtype (default float32; bfloat16 on TPU/GPU)")
    p.add_argument("--json", action="store_true", help="print one JSON document")
    p.set_defaults(func=cmd_embed)
