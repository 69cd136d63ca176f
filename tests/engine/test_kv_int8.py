"""The engine with an int8 KV cache (`EngineConfig(cache_dtype="int8")`, models/kv_quant.py):
its pools hold int8 rows with their scales, a request's tokens are the same alone and in any
batch (seeded sampling included), greedy decoding follows the model read through an int8
cache, speculative verify steps give decode's tokens, and the memory plan counts the int8
rows' bytes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from metrale_jax.engine import SlotSettings
from metrale_jax.engine.memory_plan import token_bytes_per_device
from metrale_jax.models.kv_quant import SCALE_BYTES
from metrale_jax.models.ragged import sequence_logits
from metrale_jax.models.transformer import Transformer
from tests.engine.conftest import TINY, make_engine
from tests.engine.test_engine import check_batch_invariance_and_seeds, run
from tests.engine.test_speculative import SAMPLED, K, _decode, _speculate


@pytest.fixture(scope="module")
def int8_engine():
    """The tiny Llama of the engine tests (logits scaled up for clear argmaxes), int8 cache."""
    graphdef, params = nnx.split(Transformer(TINY, rngs=nnx.Rngs(0)))
    params = jax.tree.map(lambda x: x * 10.0 if x.ndim > 1 else x, params)
    return make_engine(TINY, graphdef, params, cache_dtype="int8", speculative_tokens=K)


def test_pools_hold_int8_rows_with_their_scales(int8_engine):
    state = int8_engine.init_decode_state()
    pool = state.pages[0]
    assert pool.dtype == jnp.int8
    assert pool.shape[1:] == (int8_engine.config.page_size, 2 * TINY.num_kv_heads,
                              TINY.head_dim + SCALE_BYTES)
    assert len(state.pages) == TINY.num_layers


def test_batch_invariance_and_seeds_with_an_int8_cache(int8_engine):
    check_batch_invariance_and_seeds(int8_engine)


def test_greedy_follows_the_model_read_through_an_int8_cache(int8_engine):
    """Teacher-forced: at every position of prompt + output, the engine's greedy token is the
    argmax of the logits computed through an int8 page pool (`sequence_logits`), for a prompt
    that is prefilled in two pieces (its second reads the first's int8 context)."""
    prompt = np.random.default_rng(3).integers(0, TINY.vocab_size, 45).tolist()
    out = run(int8_engine, [(2, prompt, SlotSettings())])[2][0]
    logits = sequence_logits(int8_engine.graph, int8_engine.params, prompt + out[:-1],
                             page_size=int8_engine.config.page_size, cache_dtype=jnp.int8,
                             chunk=32)
    forced = np.asarray(jnp.argmax(logits[len(prompt) - 1:], -1)).tolist()
    assert forced == out


def test_verify_matches_decode_with_an_int8_cache(int8_engine):
    """Speculative verify steps give the tokens decode steps give (greedy and seeded), each
    verify token attending as a decode row through the kernel's int8 target."""
    from metrale_jax.kernels import decode_attention as cpu_kernel
    for settings in (SlotSettings(), SAMPLED):
        reference = _decode(int8_engine, settings)
        tokens, accepted = _speculate(int8_engine, settings, reference)
        assert tokens == reference, settings.temperature
        assert accepted >= 10
    if cpu_kernel.available():
        hlo = int8_engine.step_programs.verify(int8_engine.config.max_slots).as_text()
        assert cpu_kernel.TARGET_INT8 in hlo


def test_memory_plan_counts_int8_rows():
    f32 = token_bytes_per_device(TINY, 4, (1, 1))
    i8 = token_bytes_per_device(TINY, 1, (1, 1))
    rows = TINY.num_layers * 2 * TINY.num_kv_heads
    assert f32 == rows * TINY.head_dim * 4
    assert i8 == rows * (TINY.head_dim + SCALE_BYTES)
