"""Greedy decoding through the engine equals transformers' `generate(do_sample=False)`.

Five prompts (1, 15, 16, 17 tokens, and 45 tokens: chunked, the largest bucket is 32) go into
the engine together and decode 48 tokens each; every slot must match transformers' greedy
continuation of that prompt alone.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import pytest
import torch

from devtools.hf_models import build_hf_model
from metrale_jax.engine import SlotSettings
from metrale_jax.weights.assemble import assemble_params
from metrale_jax.weights.hf_config import read_hf_config
from metrale_jax.weights.safetensors_reader import read_safetensors
from tests.engine.conftest import make_engine

NEW_TOKENS = 48
PROMPT_LENGTHS = (1, 15, 16, 17, 45)


def run_engine(engine, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """Prefills every prompt into its own slot and decodes `new_tokens` tokens greedily."""
    state = engine.init_decode_state()
    items = [(slot, p, SlotSettings()) for slot, p in enumerate(prompts)]
    state, first = engine.add(state, items)
    outs = [np.asarray(first.tokens)[0, : len(prompts)]]
    for _ in range(new_tokens - 1):
        state, step = engine.step(state)
        outs.append(np.asarray(step.tokens)[0, : len(prompts)])
    return np.stack(outs, axis=1).tolist()


class Model(NamedTuple):
    """A tiny HF model of one family and an engine (max_len 256) over its weights."""
    hf: torch.nn.Module
    cfg: object
    engine: object


@pytest.fixture(scope="module")
def model(request, tmp_path_factory) -> Model:
    """The tiny model and engine of the family `request.param`, one a module: both tests
    run gemma2's (one build, one compile of its programs)."""
    folder = tmp_path_factory.mktemp(request.param)
    hf = build_hf_model(request.param, folder)
    hf.generation_config.eos_token_id = None
    cfg = read_hf_config(folder)
    graphdef, params = assemble_params(cfg, read_safetensors(folder), folder)
    return Model(hf, cfg, make_engine(cfg, graphdef, params, max_len=256))


@pytest.mark.parametrize("model", ["llama", "gemma2", "gemma3", "qwen2"], indirect=True)
def test_greedy_matches_transformers(model):
    hf, cfg, engine = model
    arch = cfg.architecture
    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in PROMPT_LENGTHS]
    ours = run_engine(engine, prompts, NEW_TOKENS)
    for prompt, got in zip(prompts, ours, strict=True):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), do_sample=False,
                              max_new_tokens=NEW_TOKENS, eos_token_id=None, pad_token_id=0)
        ref = ref[0, len(prompt):].tolist()
        assert len(ref) == NEW_TOKENS
        assert got == ref, f"{arch}, prompt of {len(prompt)} tokens"


@pytest.mark.parametrize("model", ["mistral", "gemma2"], indirect=True)
def test_greedy_across_attention_lengths_with_few_active_slots(model):
    """Two requests in an 8-slot engine (only the first rows are computed), decoding from
    position ~100 past 128, where attention switches to a longer cache prefix; both archs
    have sliding-window layers (window 8)."""
    hf, cfg, engine = model
    arch = cfg.architecture
    rng = np.random.default_rng(11)
    prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (100, 111)]
    state = engine.init_decode_state()
    state, first = engine.add(state, [(0, prompts[0], SlotSettings()),
                                      (1, prompts[1], SlotSettings())])
    active = np.arange(engine.config.max_slots) < 2
    outs = [np.asarray(first.tokens)[0, :2]]
    for _ in range(NEW_TOKENS - 1):
        state, step = engine.step(state, active)
        outs.append(np.asarray(step.tokens)[0, :2])
    ours = np.stack(outs, axis=1).tolist()
    for prompt, got in zip(prompts, ours, strict=True):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), do_sample=False,
                              max_new_tokens=NEW_TOKENS, eos_token_id=None, pad_token_id=0)
        assert got == ref[0, len(prompt):].tolist(), f"{arch}, prompt of {len(prompt)} tokens"
