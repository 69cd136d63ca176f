"""Our Flax models against transformers on PyTorch (CPU, float32): the same logits.

For every architecture, a tiny random transformers model is saved with `save_pretrained` and
loaded through our safetensors reader; logits on random prompts must agree within
1e-4 · max|logit| and give the same argmax at every position, through the engine's ragged layers
over the paged cache (`models/ragged.py`), for a whole prompt in one chunk
and for the same prompt fed in chunks through the cache.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from devtools.fidelity_references import DATA, FAMILIES, load_references, transformers_logits
from devtools.hf_models import ARCH_CONFIGS, build_hf_model
from devtools.logits import stacked_logits
from metrale_jax.weights.assemble import assemble_params
from metrale_jax.weights.hf_config import read_hf_config
from metrale_jax.weights.safetensors_reader import read_safetensors

ARCHS = sorted(ARCH_CONFIGS)
ACCELERATOR_ARCHS = FAMILIES  # `make device-check` runs these two (torch-free: the stored file)


@pytest.fixture(scope="module", params=[
    pytest.param(a, marks=pytest.mark.accelerator) if a in ACCELERATOR_ARCHS else a
    for a in ARCHS])
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


FULL_LENGTHS = (1, 7, 24)


def test_full_forward_matches_transformers(pair):
    """Each prompt prefilled in one chunk through the engine's ragged layers: a chunk of the
    longest length, the shorter prompts padded as the engine pads them to its chunk bucket
    (one compiled program for the three lengths)."""
    arch, hf, cfg, graphdef, params = pair
    rng = np.random.default_rng(1)
    for length in FULL_LENGTHS:
        ids = rng.integers(0, cfg.vocab_size, size=(2, length))
        ref = hf_logits(hf, ids)
        ours = stacked_logits(graphdef, params, ids, chunk=max(FULL_LENGTHS))
        err = np.abs(ours - ref).max() / np.abs(ref).max()
        assert err <= 1e-4, f"{arch} len {length}: max relative logit error {err:.2e}"
        np.testing.assert_array_equal(ours.argmax(-1), ref.argmax(-1))


def test_chunked_through_cache_matches_transformers(pair):
    """Prefill in chunks of 5 into pages of 4: later chunks read the earlier ones' keys and
    values back from the paged cache."""
    arch, hf, cfg, graphdef, params = pair
    ids = np.random.default_rng(2).integers(0, cfg.vocab_size, size=(1, 23))
    ref = hf_logits(hf, ids)
    ours = stacked_logits(graphdef, params, ids, chunk=5, page_size=4)
    err = np.abs(ours - ref).max() / np.abs(ref).max()
    assert err <= 1e-4, f"{arch}: max relative logit error {err:.2e} through the cache"
    np.testing.assert_array_equal(ours.argmax(-1), ref.argmax(-1))


def test_bfloat16_params_stay_close(pair):
    """bfloat16 params (and cache): same shapes, logits within bfloat16's precision of
    float32."""
    arch, hf, cfg, _, _ = pair
    tensors = {k: v.detach().numpy() for k, v in hf.state_dict().items()}
    graphdef16, params16 = assemble_params(cfg, tensors, arch, jnp.bfloat16)
    ids = np.random.default_rng(4).integers(0, cfg.vocab_size, size=(1, 16))
    ref = hf_logits(hf, ids)
    ours = stacked_logits(graphdef16, params16, ids)
    assert ours.dtype == np.float32
    err = np.abs(ours - ref).max() / np.abs(ref).max()
    assert err <= 5e-2, f"{arch}: bfloat16 max relative logit error {err:.2e}"


@pytest.mark.parametrize("arch", FAMILIES)
def test_stored_references_are_current(arch, tmp_path):
    """tests/data/fidelity/<arch> (test_fidelity_stored.py's torch-free references) holds
    `build_hf_model`'s tiny model rounded to float16, and its logits are what transformers
    gives for that folder today (if not: `python -m devtools.fidelity_references`)."""
    folder = DATA / arch
    stored = read_safetensors(folder)
    fresh = build_hf_model(arch, tmp_path).state_dict()
    assert set(stored) <= set(fresh), f"{arch}: stored tensors the model lacks"
    for name, value in stored.items():
        np.testing.assert_array_equal(value, fresh[name].half().numpy(), err_msg=name)
    refs = load_references(folder)
    now = transformers_logits(folder, {n: ids for n, (ids, _) in refs.items()})
    for n, (_, ref) in refs.items():
        err = np.abs(now[n] - ref).max() / np.abs(ref).max()
        assert err <= 1e-5, f"{arch} len {n}: stored logits off transformers' by {err:.2e}"
