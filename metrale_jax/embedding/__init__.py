"""Pooling models: embeddings, reranking and pair scores.

What lives here: the `Pooler` contract every served pooling model meets (`pooler.py`), the
sentence-transformers configuration (pooling mode, normalization, length), the encoder
runner (BERT-family models in their own bucketed programs, batched over callers) and the
decoder pooler (a decoder family's last hidden state through the scheduler's ragged steps).

May import: metrale_jax.config, errors, models, weights, text, engine, scheduler. Nothing
in metrale_jax imports this package except `llm.py`; `serving` uses it.
"""

from metrale_jax.embedding.pooler import Pooler, PoolerInfo, cosine_scores

MAY_IMPORT = ("metrale_jax.config", "metrale_jax.errors", "metrale_jax.models",
              "metrale_jax.weights", "metrale_jax.text", "metrale_jax.engine",
              "metrale_jax.scheduler", "metrale_jax.families")

__all__ = ["Pooler", "PoolerInfo", "cosine_scores"]
