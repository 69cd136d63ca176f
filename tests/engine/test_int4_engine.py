"""The engine on int4 weights (`EngineConfig(quantization="int4")`, models/quant4.py): it
quantizes a float model it is given, a request's tokens are the same alone and in any batch
(seeded sampling included), greedy decoding follows the int4 model's own argmax, speculative
verify steps give decode's tokens, and the memory plan counts the packed bytes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from devtools.logits import stacked_logits
from metrale_jax.engine import SlotSettings
from metrale_jax.engine.memory_plan import param_bytes_per_device
from metrale_jax.models.quantized_model import quantize_state
from metrale_jax.models.scanned import StackedLayerParams
from metrale_jax.models.transformer import Transformer
from tests.engine.conftest import TINY, make_engine
from tests.engine.test_engine import check_batch_invariance_and_seeds, run
from tests.engine.test_speculative import SAMPLED, K, _decode, _speculate


@pytest.fixture(scope="module")
def float_model():
    """The tiny Llama of the engine tests (logits scaled up for clear argmaxes)."""
    graphdef, params = nnx.split(Transformer(TINY, rngs=nnx.Rngs(0)))
    return graphdef, jax.tree.map(lambda x: x * 10.0 if x.ndim > 1 else x, params)


@pytest.fixture(scope="module")
def int4_engine(float_model):
    return make_engine(TINY, *float_model, quantization="int4", speculative_tokens=K)


def test_the_engine_holds_int4_weights(int4_engine):
    assert int4_engine.model_config.quantization == "int4"
    # int4 weights run their layers as a scan on CPU too (EngineConfig.layer_loop): stacked.
    assert isinstance(int4_engine.params, StackedLayerParams)
    blocks = int4_engine.params.blocks
    assert blocks["mlp"]["down"].dtype == jnp.uint8
    assert blocks["mlp"]["down"].shape == (TINY.num_layers, TINY.hidden_size,
                                           TINY.intermediate_size // 2)
    assert blocks["mlp"]["down_scale"].dtype == jnp.float16  # not cast to the compute dtype
    assert int4_engine.params.outer["embed"].dtype == jnp.int8


@pytest.mark.accelerator
def test_batch_invariance_and_seeds_with_int4_weights(int4_engine):
    check_batch_invariance_and_seeds(int4_engine)


@pytest.mark.accelerator
def test_greedy_follows_the_int4_model(int4_engine, float_model):
    """Teacher-forced: at every position of prompt + output, the engine's greedy token is the
    argmax of the int4 model's forward over the whole sequence (its rows run the same
    kernel per token as decode)."""
    prompt = np.random.default_rng(3).integers(0, TINY.vocab_size, 9).tolist()
    out = run(int4_engine, [(1, prompt, SlotSettings())])[1][0]
    _, qgraph, qparams = quantize_state(TINY, float_model[1], "int4")
    logits = stacked_logits(qgraph, qparams, [prompt + out[:-1]])
    assert logits[0, len(prompt) - 1:].argmax(-1).tolist() == out


def test_verify_matches_decode_with_int4_weights(int4_engine):
    """Speculative verify steps (k + 1 rows a sequence through the kernel) give the tokens
    decode steps give, greedy and seeded: a row's result does not depend on the others."""
    for settings in (SlotSettings(), SAMPLED):
        reference = _decode(int4_engine, settings)
        tokens, accepted = _speculate(int4_engine, settings, reference)
        assert tokens == reference, settings.temperature
        assert accepted >= 10


def test_memory_plan_counts_packed_bytes():
    """int4 linear weights: half a byte each and 4 bytes of float16 (d, m) per 32; the
    embedding and head int8 with float scales; the rest float."""
    E, F, V, L = TINY.hidden_size, TINY.intermediate_size, TINY.vocab_size, TINY.num_layers
    HD, KD = TINY.num_heads * TINY.head_dim, TINY.num_kv_heads * TINY.head_dim
    linear = E * HD * 2 + E * KD * 2 + E * F * 3  # q, o; k, v; gate, up, down
    head = V * E * (1 + (not TINY.tie_word_embeddings))
    floats = L * 2 * E + E + V * (1 + (not TINY.tie_word_embeddings))  # norms, row scales
    want = L * linear // 2 + L * linear // 32 * 4 + head + floats * 4
    assert param_bytes_per_device(TINY, 4, (1, 1), "int4") == want
