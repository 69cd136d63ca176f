"""Our Flax models against stored transformers logits: fidelity without torch.

`tests/models/test_fidelity_hf.py` builds its tiny models and references with torch, which a
lent TPU or GPU host does not have. Here the same tiny models of the two families
`make device-check` runs are read from `tests/data/fidelity/<family>/` (float16 safetensors,
loaded in float32 through our safetensors reader) and compared with transformers' float32
logits stored beside them (`python -m devtools.fidelity_references` writes both; where torch
is there, `test_fidelity_hf.py::test_stored_references_are_current` checks they are current).
The bounds are test_fidelity_hf.py's: 1e-4 · max|logit| and the same argmax at every position
in float32, whole and chunked through the paged cache, and 5e-2 · max|logit| in bfloat16.
Nothing here imports torch.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from devtools.fidelity_references import DATA, FAMILIES, LENGTHS, load_references
from devtools.logits import stacked_logits
from metrale_jax.weights.assemble import assemble_params
from metrale_jax.weights.hf_config import read_hf_config
from metrale_jax.weights.safetensors_reader import read_safetensors

pytestmark = pytest.mark.accelerator  # `make device-check` runs these on a host without torch


@pytest.fixture(scope="module", params=FAMILIES)
def stored(request):
    """(family, config, the folder's tensors, float32 graphdef and params, references)."""
    folder = DATA / request.param
    cfg = read_hf_config(folder)
    tensors = read_safetensors(folder)
    graphdef, params = assemble_params(cfg, tensors, folder)
    return request.param, cfg, tensors, graphdef, params, load_references(folder)


def relative_error(ours: np.ndarray, ref: np.ndarray) -> float:
    """max |ours - ref| / max |ref| over all positions and the vocabulary."""
    return float(np.abs(ours - ref).max() / np.abs(ref).max())


def test_whole_prompt_matches_stored(stored):
    """Each prompt batch (lengths 1, 7, 24) prefilled in one chunk of the longest length, the
    shorter ones padded to it as the engine pads a chunk."""
    arch, _, _, graphdef, params, refs = stored
    for length in LENGTHS:
        ids, ref = refs[length]
        ours = stacked_logits(graphdef, params, ids, chunk=max(LENGTHS))
        err = relative_error(ours, ref)
        assert err <= 1e-4, f"{arch} len {length}: max relative logit error {err:.2e}"
        np.testing.assert_array_equal(ours.argmax(-1), ref.argmax(-1))


def test_chunked_through_cache_matches_stored(stored):
    """The longest prompts in chunks of 5 into pages of 4 (the last chunk partial): later
    chunks read the earlier ones' keys and values back from the paged cache."""
    arch, _, _, graphdef, params, refs = stored
    ids, ref = refs[max(LENGTHS)]
    ours = stacked_logits(graphdef, params, ids, chunk=5, page_size=4)
    err = relative_error(ours, ref)
    assert err <= 1e-4, f"{arch}: max relative logit error {err:.2e} through the cache"
    np.testing.assert_array_equal(ours.argmax(-1), ref.argmax(-1))


def test_bfloat16_params_stay_close(stored):
    """bfloat16 params (and cache): logits within bfloat16's precision of transformers'
    float32 ones."""
    arch, cfg, tensors, _, _, refs = stored
    graphdef16, params16 = assemble_params(cfg, tensors, arch, jnp.bfloat16)
    ids, ref = refs[max(LENGTHS)]
    ours = stacked_logits(graphdef16, params16, ids)
    assert ours.dtype == np.float32
    err = relative_error(ours, ref)
    assert err <= 5e-2, f"{arch}: bfloat16 max relative logit error {err:.2e}"
