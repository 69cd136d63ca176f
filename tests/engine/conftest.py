"""Shared tiny engines for the engine tests (compiled once per session).

The persistent compilation cache is the suite's (`tests.conftest.CACHE`: the repo's
git-ignored `.jax_cache/tests`, or $METRALE_TEST_JAX_CACHE), so a second run of the suite
skips most XLA compiles.
"""

from __future__ import annotations

import jax
import pytest
from flax import nnx

from metrale_jax.config import ModelConfig
from metrale_jax.engine import Engine, EngineConfig
from metrale_jax.models.transformer import Transformer
from tests.conftest import CACHE

CACHE_DIR = str(CACHE)

# Small shapes: buckets 16 and 32 (prompts over 32 tokens are chunked), batches 1 and 2.
TEST_ENGINE = dict(max_slots=8, max_len=128, min_prefill_bucket=16, max_prefill_len=32,
                   max_prefill_batch=2, num_top_logprobs=5, compilation_cache_dir=CACHE_DIR)

TINY = ModelConfig("llama", vocab_size=512, hidden_size=64, intermediate_size=128,
                   num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16)


def make_engine(cfg: ModelConfig, graphdef, params, **overrides) -> Engine:
    """An engine of the test shapes (`TEST_ENGINE`), with `overrides` applied."""
    return Engine(cfg, graphdef, params, EngineConfig(**{**TEST_ENGINE, **overrides}))


@pytest.fixture(scope="session")
def tiny_engine() -> Engine:
    """A warmed-up engine over a random-init tiny Llama, logits scaled up for clear argmaxes."""
    graphdef, params = nnx.split(Transformer(TINY, rngs=nnx.Rngs(0)))
    params = jax.tree.map(lambda x: x * 10.0 if x.ndim > 1 else x, params)
    engine = make_engine(TINY, graphdef, params)
    engine.warmup()
    return engine
