"""The mixture-of-experts MLP (`models/moe.py`): routing with forced router logits (every
token reaches exactly its top-k experts, none dropped at any batch composition), the two
forms of the grouped product against a per-token reference, and int8 experts close to
float."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from devtools.hf_models import build_hf_model
from devtools.logits import stacked_logits
from metrale_jax.config import ModelConfig
from metrale_jax.errors import InvalidParameterError
from metrale_jax.models.moe import MoE, dispatch_form, expert_mix, route, tile_rows
from metrale_jax.models.quantized_model import quantize_state
from metrale_jax.weights.assemble import assemble_params
from metrale_jax.weights.hf_config import read_hf_config
from metrale_jax.weights.safetensors_reader import read_safetensors
from tests.models.test_quant import dequantized

X, K, E, F = 8, 3, 16, 8
CFG = ModelConfig("qwen3_moe", vocab_size=64, hidden_size=E, intermediate_size=32,
                  num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8, qk_norm=True,
                  num_experts=X, experts_per_token=K, moe_intermediate_size=F)


def reference(x, weights, experts, w) -> np.ndarray:
    """Per token, per chosen expert: the expert's gated MLP times its weight, in numpy."""
    x, weights, experts = np.asarray(x), np.asarray(weights), np.asarray(experts)
    gate, up, down = (np.asarray(w[n][0]) for n in ("gate", "up", "down"))
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(experts.shape[1]):
            e = experts[t, j]
            g, u = x[t] @ gate[e], x[t] @ up[e]
            out[t] += weights[t, j] * ((g / (1 + np.exp(-g)) * u) @ down[e])
    return out


def forced_moe(seed: int = 0) -> MoE:
    """A MoE layer whose router is the identity on x's first X features (logits = x[:, :X])."""
    moe = MoE(CFG, jnp.float32, nnx.Rngs(seed))
    moe.router = nnx.Param(jnp.eye(E, X, dtype=jnp.float32))
    return moe


def forced_inputs(logits: np.ndarray, seed: int) -> jax.Array:
    rest = np.random.default_rng(seed).normal(size=(logits.shape[0], E - X))
    return jnp.asarray(np.concatenate([logits, rest], axis=1), jnp.float32)


@pytest.mark.parametrize("normalize", [False, True])
def test_forced_router_logits_pick_the_top_k(normalize):
    logits = np.random.default_rng(0).permuted(np.tile(np.arange(X, dtype=np.float32),
                                                       (5, 1)), axis=1)
    weights, experts = route(jnp.asarray(logits), K, normalize)
    want = np.argsort(-logits, axis=1)[:, :K]
    np.testing.assert_array_equal(np.asarray(experts), want)
    probs = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)
    top = np.take_along_axis(probs, want, axis=1)
    if normalize:  # Mixtral: a softmax over the top k logits
        top = np.exp(np.take_along_axis(logits, want, 1))
        top = top / top.sum(1, keepdims=True)
    np.testing.assert_allclose(np.asarray(weights), top, rtol=1e-6)


@pytest.mark.parametrize("form", [("ragged", 0), ("tiles", 1), ("tiles", 4), ("tiles", 32)])
@pytest.mark.parametrize("tokens", [1, 5, 40])
def test_every_token_reaches_exactly_its_experts(form, tokens):
    """Forced logits, the grouped product against the per-token reference, and the counts."""
    rng = np.random.default_rng(tokens)
    logits = rng.normal(size=(tokens, X)).astype(np.float32) * 3
    logits[: tokens // 2, 0] = 50.0  # half the tokens pile onto expert 0: uneven groups
    moe = forced_moe()
    x = forced_inputs(logits, tokens)
    out, counts = moe(x, form=form)
    weights, experts = route(jnp.asarray(logits), K, False)
    np.testing.assert_allclose(np.asarray(out),
                               reference(x, weights, experts, moe.expert_weights()),
                               rtol=1e-4, atol=1e-6)
    want = np.bincount(np.argsort(-logits, axis=1)[:, :K].ravel(), minlength=X)
    np.testing.assert_array_equal(np.asarray(counts), want)
    assert int(np.asarray(counts).sum()) == tokens * K


def test_no_token_dropped_at_any_batch_composition():
    """Each token's output is the same alone, in any subset and in any order of the batch."""
    rng = np.random.default_rng(3)
    logits = rng.normal(size=(24, X)).astype(np.float32)
    logits[:12, 2] = 40.0  # an expert takes half the batch: nothing is capped
    moe = forced_moe()
    x = forced_inputs(logits, 3)
    whole, _ = moe(x)
    for size in (1, 2, 7, 13):
        pick = rng.permutation(24)[:size]
        part, counts = moe(x[pick])
        np.testing.assert_allclose(np.asarray(part), np.asarray(whole)[pick], rtol=1e-5,
                                   atol=1e-6)
        assert int(np.asarray(counts).sum()) == size * K


def test_real_mask_counts_only_real_tokens():
    moe = forced_moe()
    logits = np.zeros((4, X), np.float32)
    logits[:, 5] = 9.0
    _, counts = moe(forced_inputs(logits, 0), jnp.asarray([True, False, True, False]))
    assert int(np.asarray(counts)[5]) == 2 and int(np.asarray(counts).sum()) == 2 * K


def test_forms_agree_and_the_cpu_picks_tiles():
    rng = np.random.default_rng(5)
    moe = forced_moe()
    x = jnp.asarray(rng.normal(size=(33, E)), jnp.float32)
    weights, experts = route(x @ moe.router[...], K, True)
    w = moe.expert_weights()
    a = expert_mix(x, weights, experts, w, "silu", ("ragged", 0))
    b = expert_mix(x, weights, experts, w, "silu", ("tiles", 8))
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    assert dispatch_form(8, 128, "cpu", 1) == ("tiles", 1)
    assert dispatch_form(2048, 128, "cpu", 1) == ("tiles", 32)
    assert dispatch_form(8, 128, "cpu", 8) == ("ragged", 0)  # a mesh: experts partitioned
    assert dispatch_form(8, 128, "tpu", 1) == ("ragged", 0)
    assert [tile_rows(a, 128) for a in (8, 128, 512)] == [1, 4, 8]


def test_int4_experts_are_refused_and_int8_experts_stay_close(tmp_path):
    with pytest.raises(InvalidParameterError, match="int4"):
        dataclasses.replace(CFG, quantization="int4")
    build_hf_model("qwen3_moe", tmp_path)
    cfg = read_hf_config(tmp_path)
    graphdef, params = assemble_params(cfg, read_safetensors(tmp_path), tmp_path)
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, size=(1, 20))
    ref = stacked_logits(graphdef, params, ids)
    qcfg, qgraph, qparams = quantize_state(cfg, params, "int8")
    moe = nnx.to_pure_dict(qparams)["blocks"]["moe"]
    assert moe["gate"].dtype == jnp.int8 and moe["gate_scale"].shape == (3, 8, 32)
    ours = stacked_logits(qgraph, qparams, ids)
    deq = jax.tree.map(lambda x: x, params)
    nnx.replace_by_pure_dict(deq, dequantized(qcfg, qparams))
    scale = np.abs(ref).max()
    # the int8 experts compute the float model of their dequantized weights ...
    assert np.abs(ours - stacked_logits(graphdef, deq, ids)).max() <= 1e-5 * scale
    # ... within test_quant's first-order bound of the float32 model
    err = np.abs(ours - ref).max() / scale
    assert err <= 4 * cfg.num_layers / 254, f"int8 experts: max relative logit error {err:.2e}"
    # the same int8 model straight from the checkpoint
    q2 = assemble_params(qcfg, read_safetensors(tmp_path), tmp_path)[1]
    np.testing.assert_array_equal(np.asarray(nnx.to_pure_dict(q2)["blocks"]["moe"]["down"]),
                                  np.asarray(moe["down"]))
