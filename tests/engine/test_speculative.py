"""Speculative decoding's verify step (engine/speculative.py) against plain decode steps.

Per architecture family (llama; gemma2: sliding window, soft-caps, post-norms; qwen2 differs
only by biases in the projections the verify step shares with decode, so it is left out),
one small engine without warmup (it compiles the programs it runs; test_greedy_hf's shapes
and models, so only the verify program is new to the suite) generates a prompt's continuation
with decode steps, then again with verify steps whose drafts are that continuation with every
third token corrupted (so each verify accepts some drafts and rejects one) or prompt lookup's
own drafts, verify and decode steps interleaved. The tokens, greedy and seeded sampling with
penalties, must be the same: a verify step samples each position with the key and history a
decode step would use there.
"""

from __future__ import annotations

import numpy as np
import pytest

from devtools.hf_models import build_hf_model
from metrale_jax.engine import SlotSettings
from metrale_jax.scheduler.ngram_draft import propose
from metrale_jax.weights.assemble import assemble_params
from metrale_jax.weights.hf_config import read_hf_config
from metrale_jax.weights.safetensors_reader import read_safetensors
from tests.engine.conftest import make_engine

ARCHS = ("llama", "gemma2")  # gemma2: its sliding layers keep rings (window_cache)
"""test_greedy_hf's tiny models and engine shapes (max_len 256): their prefill and decode
programs come from the compilation cache that those tests fill; only the verify program is
new."""
SLOT = 7  # the last row: decode steps of all 8 rows, as test_greedy_hf's
K = 4
STEPS = 28
# A repeating pattern: prompt lookup finds drafts at once.
PROMPT = [5, 17, 33, 90, 7, 5, 17, 33, 90, 7, 5, 17, 33, 91, 7, 5, 17]  # 17: a 32-chunk
SAMPLED = SlotSettings(temperature=0.9, top_p=0.95, seed=1234, repetition_penalty=1.3,
                       frequency_penalty=0.4)


def _engine(arch: str, folder):
    build_hf_model(arch, folder)
    cfg = read_hf_config(folder)
    graphdef, params = assemble_params(cfg, read_safetensors(folder), folder)
    return make_engine(cfg, graphdef, params, max_len=256, speculative_tokens=K)


def _active(engine) -> np.ndarray:
    return np.arange(engine.config.max_slots) == SLOT


def _decode(engine, settings: SlotSettings) -> list[int]:
    state = engine.init_decode_state()
    state, first = engine.add(state, [(SLOT, PROMPT, settings)])
    tokens = [int(first.tokens[0, 0])]
    active = _active(engine)
    while len(tokens) < STEPS:
        state, out = engine.step(state, active)
        tokens.append(int(np.asarray(out.tokens)[0, SLOT]))
    return tokens


def _speculate(engine, settings: SlotSettings, reference: list[int]) -> tuple[list[int], int]:
    """Verify steps (drafts: the reference corrupted, or prompt lookup's) with a decode step
    after every third; returns the tokens and the drafts accepted."""
    state = engine.init_decode_state()
    state, first = engine.add(state, [(SLOT, PROMPT, settings)])
    tokens = [int(first.tokens[0, 0])]
    active = _active(engine)
    accepted = i = 0
    while len(tokens) < STEPS:
        i += 1
        if i % 3 == 0:
            state, out = engine.step(state, active)
            tokens.append(int(np.asarray(out.tokens)[0, SLOT]))
            continue
        if i % 2:
            draft = list(reference[len(tokens):len(tokens) + K])
            if len(draft) > 2:
                draft[2] = (draft[2] + 1) % engine.vocab_size
        else:
            draft = propose(PROMPT + tokens, K)
        drafts = [[] for _ in range(engine.config.max_slots)]
        drafts[SLOT] = draft
        state, out, emitted = engine.verify(state, active, None, drafts)
        assert emitted.sum() == emitted[SLOT] and 1 <= emitted[SLOT] <= len(draft) + 1
        accepted += int(emitted[SLOT]) - 1
        tokens += [int(t) for t in np.asarray(out.tokens)[:emitted[SLOT], SLOT]]
    return tokens[:STEPS], accepted


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return _engine("llama", tmp_path_factory.mktemp("llama"))


@pytest.mark.parametrize("arch", ARCHS)
def test_verify_matches_decode(arch, tmp_path, llama):
    engine = llama if arch == "llama" else _engine(arch, tmp_path)
    compiled = None
    for settings in (SlotSettings(), SAMPLED):
        reference = _decode(engine, settings)
        tokens, accepted = _speculate(engine, settings, reference)
        assert tokens == reference, (arch, settings.temperature)
        assert accepted >= 10  # the corrupted drafts alone accept 2 per verify
        compiled = compiled or engine.compile_count
    assert engine.compile_count == compiled  # other settings and drafts compile nothing


def test_sampled_frequencies_match_the_target(llama):
    """Chi-square: tokens emitted under speculation follow the target distribution.

    Every row of the llama engine holds one context (the same prompt, its next input set to
    one token by `beam_set`, again before each call: the context never changes, the seeds
    and step indices do). Each verify call drafts [d1, d2]: d1 the context's second most
    likely token (accepted about p(d1) of the time), d2 the most likely after d1. The first
    emitted token must follow p0 (top-4 at temperature 1, known exactly from the returned
    raw log-probabilities) whether d1 was accepted or rejected and resampled; given it is
    d1, the second must follow p1 likewise. 8 rows x 120 calls = 960 draws, fixed seeds, so
    the test is deterministic; the bound (p > 1e-3 for each test, 3 degrees of freedom) is
    met by a correct sampler with probability 0.999 for a fresh choice of seeds, while
    accepting every draft (or never) moves the statistics by orders of magnitude.
    """
    from scipy.stats import chisquare

    engine = llama
    B = engine.config.max_slots
    settings = [SlotSettings(temperature=1.0, top_k=4, seed=100 + b) for b in range(B)]
    state = engine.init_decode_state()
    state, _ = engine.add(state, [(b, PROMPT, settings[b]) for b in range(B)])
    active = np.ones(B, np.bool_)
    reset = [(b, 7, len(PROMPT)) for b in range(B)]

    def call(drafts):
        nonlocal state
        state = engine.beam_set(state, reset, [])
        engine.lengths[:] = len(PROMPT)  # the host's mirror of the positions, set alike
        state, out, emitted = engine.verify(state, active, None, [drafts] * B)
        return out.to_numpy(), emitted

    def top4(ids, lps):
        p = np.exp(lps[:4].astype(np.float64) - lps[:4].max())
        return [int(i) for i in ids[:4]], p / p.sum()

    out, _ = call([])
    ids0, p0 = top4(out.top_ids[0, 0], out.top_logprobs[0, 0])
    d1 = ids0[1]
    out, _ = call([d1])
    ids1, p1 = top4(out.top_ids[1, 0], out.top_logprobs[1, 0])
    first, second = np.zeros(4), np.zeros(4)
    for _ in range(120):
        out, emitted = call([d1, ids1[0]])
        assert (emitted >= 1).all()
        for b in range(B):
            first[ids0.index(int(out.tokens[0, b]))] += 1
            if out.tokens[0, b] == d1:
                second[ids1.index(int(out.tokens[1, b]))] += 1
    assert chisquare(first, first.sum() * p0).pvalue > 1e-3, (first, p0)
    assert chisquare(second, second.sum() * p1).pvalue > 1e-3, (second, p1)
    assert min(first.sum() * p0.min(), second.sum() * p1.min()) >= 5  # chi-square holds
