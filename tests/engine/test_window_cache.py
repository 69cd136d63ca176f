"""The sliding-window layers' rings (`models/window_cache.py`, `sliding_cache="window"`).

A tiny Gemma 3 (window 8, three local layers and one global) decodes past its window many
times over, with long prompts cut into pieces that wrap the rings: its greedy tokens equal
transformers' (whose cache holds every position), unrolled and scanned, alone and beside
other rows. The
rings' memory does not grow with max_len while the global layers' pool does; beam search and
the prefix cache are off for such an engine, with a clear error for a beam request.
"""

from __future__ import annotations

import numpy as np
import pytest

from devtools.hf_models import build_hf_model
from metrale_jax.engine import SlotSettings
from metrale_jax.errors import InvalidParameterError
from metrale_jax.models.window_cache import WindowedPools
from metrale_jax.weights.assemble import assemble_params
from metrale_jax.weights.hf_config import read_hf_config
from metrale_jax.weights.safetensors_reader import read_safetensors
from tests.engine.conftest import make_engine

NEW_TOKENS = 40


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gemma3")
    hf = build_hf_model("gemma3", folder)
    hf.generation_config.eos_token_id = None
    cfg = read_hf_config(folder)
    graphdef, params = assemble_params(cfg, read_safetensors(folder), folder)
    return cfg, graphdef, params, hf


def hf_greedy(hf, prompt: list[int]) -> list[int]:
    """transformers' greedy continuation of `prompt` alone (every layer's full cache)."""
    import torch
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=NEW_TOKENS,
                          eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def greedy(engine, prompts: dict[int, list[int]], new_tokens: int = NEW_TOKENS
           ) -> dict[int, list[int]]:
    """Prefills each prompt into its slot, then decodes only those slots greedily."""
    state = engine.init_decode_state()
    slots = sorted(prompts)
    state, first = engine.add(state, [(s, prompts[s], SlotSettings()) for s in slots])
    active = np.isin(np.arange(engine.config.max_slots), slots)
    out = {s: [int(np.asarray(first.tokens)[0, i])] for i, s in enumerate(slots)}
    for _ in range(new_tokens - 1):
        state, step = engine.step(state, active)
        for s in slots:
            out[s].append(int(np.asarray(step.tokens)[0, s]))
    return out


def pool_bytes(pools) -> int:
    return sum(int(np.prod(p.shape)) * p.dtype.itemsize
               for p in (pools if isinstance(pools, tuple) else (pools,)))


@pytest.mark.parametrize("layer_loop", ["unrolled", "scan"])
def test_rings_decode_as_transformers(gemma3, layer_loop):
    """Prompts of 70, 5 and 33 tokens in chunks of 32, 40 tokens each: the 64-position rings
    wrap several times; each row's tokens equal transformers' (and the same prompt alone in
    another slot gives the same tokens)."""
    cfg, graphdef, params, hf = gemma3
    rng = np.random.default_rng(3)
    prompts = {0: rng.integers(0, cfg.vocab_size, 70).tolist(),
               3: rng.integers(0, cfg.vocab_size, 5).tolist(),
               5: rng.integers(0, cfg.vocab_size, 33).tolist()}
    engine = make_engine(cfg, graphdef, params, layer_loop=layer_loop, max_len=256)
    assert isinstance(engine.init_decode_state().pages, WindowedPools)
    # window 8 + the 32-token chunk in pages of 16: ceil(39 / 16) + 1 pages a row
    assert engine.window_columns == 4
    assert engine.pages.cache is None  # no prefix cache beside the rings
    ours = greedy(engine, prompts)
    for slot, prompt in prompts.items():
        assert ours[slot] == hf_greedy(hf, prompt), (layer_loop, len(prompt))
    assert greedy(engine, {2: prompts[0]})[2] == ours[0]  # batch invariance


def test_full_pages_when_asked(gemma3):
    """`sliding_cache="full"`: plain pools, the prefix cache on."""
    cfg, graphdef, params, _ = gemma3
    engine = make_engine(cfg, graphdef, params, sliding_cache="full")
    assert engine.window_columns == 0 and engine.pages.cache is not None
    assert isinstance(engine.init_decode_state().pages, tuple)


def test_ring_memory_does_not_grow_with_the_context(gemma3):
    cfg, graphdef, params, _ = gemma3
    sizes = {}
    for max_len in (128, 512):
        engine = make_engine(cfg, graphdef, params, max_len=max_len)
        pages = engine.init_decode_state().pages
        sizes[max_len] = (pool_bytes(pages.full), pool_bytes(pages.window))
        B, W = engine.config.max_slots, engine.window_columns
        ps, D = engine.config.page_size, cfg.head_dim
        assert all(p.shape == (B * W + 1, ps, 2 * cfg.num_kv_heads, D)
                   for p in pages.window)
        assert len(pages.window) == sum(cfg.layer_is_sliding) == 3
        assert len(pages.full) == 1
    assert sizes[128][1] == sizes[512][1]  # the rings: the same bytes at any max_len
    assert sizes[512][0] == pytest.approx(4 * sizes[128][0], rel=0.02)  # the global pool grows


def test_beam_search_is_refused_with_the_rings(tmp_path):
    """Through the Python API: a beam request is a clear `InvalidParameterError` naming the
    way out; the same model with full pages runs it."""
    from devtools.hf_models import build_tiny_checkpoint
    from metrale_jax import LLM, SamplingParams
    folder = build_tiny_checkpoint(tmp_path / "gemma3", "gemma3")
    beams = SamplingParams(num_beams=2, max_tokens=3, ignore_eos=True)
    with (LLM(folder, max_slots=4, max_len=128, max_prefill_len=32) as llm,
          pytest.raises(InvalidParameterError, match="--sliding-cache full")):
        llm.generate("the quick brown fox", beams)
    with LLM(folder, max_slots=4, max_len=128, max_prefill_len=32,
             sliding_cache="full") as llm:
        assert len(llm.generate("the quick brown fox", beams)[0].token_ids) == 3
