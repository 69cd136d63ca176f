"""Our Flax models against transformers on PyTorch (CPU, float32): the same logits.

For every architecture, a tiny random transformers model is saved with `save_pretrained` and
loaded through our safetensors reader; logits on random prompts must agree within
1e-4 · max|logit| and give the same argmax at every position, for the full-sequence forward
and for the same prompt fed in chunks through the KV cache.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from metrale_jax.models.kv_cache import KVCache
from metrale_jax.models.transformer import forward
from metrale_jax.weights.assemble import assemble_params
from metrale_jax.weights.hf_config import read_hf_config
from metrale_jax.weights.safetensors_reader import read_safetensors
from tests.hf_models import ARCH_CONFIGS, build_hf_model

ARCHS = sorted(ARCH_CONFIGS)


@pytest.fixture(scope="module", params=ARCHS)
def pair(request, tmp_path_factory):
    arch = request.param
    folder = tmp_path_factory.mktemp(arch)
    hf = build_hf_model(arch, folder)
    cfg = read_hf_config(folder)
    graphdef, params = assemble_params(cfg, read_safetensors(folder), folder)
    return arch, hf, cfg, graphdef, params


def hf_logits(hf, ids: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return hf(torch.tensor(ids)).logits.float().numpy()


def test_full_forward_matches_transformers(pair):
    arch, hf, cfg, graphdef, params = pair
    rng = np.random.default_rng(1)
    for length in (1, 7, 24):
        ids = rng.integers(0, cfg.vocab_size, size=(2, length))
        ref = hf_logits(hf, ids)
        positions = jnp.broadcast_to(jnp.arange(length), ids.shape)
        ours, _ = forward(graphdef, params, jnp.asarray(ids), positions)
        ours = np.asarray(ours)
        err = np.abs(ours - ref).max() / np.abs(ref).max()
        assert err <= 1e-4, f"{arch} len {length}: max relative logit error {err:.2e}"
        np.testing.assert_array_equal(ours.argmax(-1), ref.argmax(-1))


def test_chunked_through_cache_matches_transformers(pair):
    """Prefill in chunks of 5 into a cache, then decode one token at a time."""
    arch, hf, cfg, graphdef, params = pair
    ids = np.random.default_rng(2).integers(0, cfg.vocab_size, size=(1, 23))
    ref = hf_logits(hf, ids)
    cache = KVCache.zeros(cfg, 1, 32)
    step = jax.jit(lambda p, t, q, c: forward(graphdef, p, t, q, c))
    outs = []
    bounds = [0, 5, 10, 15, 20, 21, 22, 23]
    for a, b in itertools.pairwise(bounds):
        pos = jnp.arange(a, b)[None]
        logits, cache = step(params, jnp.asarray(ids[:, a:b]), pos, cache)
        outs.append(np.asarray(logits))
    ours = np.concatenate(outs, axis=1)
    err = np.abs(ours - ref).max() / np.abs(ref).max()
    assert err <= 1e-4, f"{arch}: max relative logit error {err:.2e} through the cache"
    np.testing.assert_array_equal(ours.argmax(-1), ref.argmax(-1))


def test_logits_index_selects_one_position(pair):
    _, _, cfg, graphdef, params = pair
    ids = jnp.asarray(np.random.default_rng(3).integers(0, cfg.vocab_size, size=(2, 9)))
    pos = jnp.broadcast_to(jnp.arange(9), ids.shape)
    full, _ = forward(graphdef, params, ids, pos)
    idx = jnp.array([3, 8])
    picked, _ = forward(graphdef, params, ids, pos, logits_index=idx)
    np.testing.assert_allclose(picked, full[jnp.arange(2), idx], rtol=1e-5, atol=1e-5)


def test_bfloat16_params_stay_close(pair):
    """bfloat16 params: same shapes, logits within bfloat16's precision of float32."""
    arch, hf, cfg, _, _ = pair
    tensors = {k: v.detach().numpy() for k, v in hf.state_dict().items()}
    graphdef16, params16 = assemble_params(cfg, tensors, arch, jnp.bfloat16)
    ids = np.random.default_rng(4).integers(0, cfg.vocab_size, size=(1, 16))
    ref = hf_logits(hf, ids)
    ours, _ = forward(graphdef16, params16, jnp.asarray(ids), jnp.arange(16)[None])
    assert ours.dtype == jnp.float32
    err = np.abs(np.asarray(ours) - ref).max() / np.abs(ref).max()
    assert err <= 5e-2, f"{arch}: bfloat16 max relative logit error {err:.2e}"
