"""Sampling controls through the engine's compiled steps (prefill, chunked prefill, decode).

Teacher-forced: with every penalty and mask on, each greedy token the engine generates is the
argmax of the NumPy reference applied to a full forward pass over the prompt and the tokens
so far, so the history the device keeps (prompt tokens at insert and in chunks, each decoded
token, the counts) is the true one. Processed logprobs describe the distribution sampled from.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from metrale_jax.engine import SlotSettings
from metrale_jax.engine.logits_processors import LZ_BUFFER, LZ_WINDOW
from metrale_jax.engine.sampling import sample
from metrale_jax.engine.sampling_state import SamplingState, TokenHistory
from metrale_jax.engine.state import settings_to_arrays
from metrale_jax.models.ragged import sequence_logits
from tests.engine import sampling_reference as ref

STEPS = 12
CONTROLS = dict(repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.3,
                dry_multiplier=1.5, dry_allowed_length=1, lz_penalty=0.3, min_tokens=4)


def reference_next(engine, ids: list[int], n_prompt: int, params: dict) -> int:
    # the whole sequence prefilled in one chunk of max_len (one program for every length)
    logits = np.asarray(sequence_logits(engine.graph, engine.params, ids,
                                        chunk=engine.config.max_len)[len(ids) - 1])
    _, kept = ref.process(logits.astype(np.float64), np.array(ids), n_prompt,
                             {**params, "temperature": 0.0, "lz_window": LZ_WINDOW,
                              "lz_buffer": LZ_BUFFER})
    return int(np.flatnonzero(kept)[0])


def generate(engine, items, steps: int) -> list[list[int]]:
    state, first = engine.add(engine.init_decode_state(), items)
    out = [[int(first.tokens[0, i])] for i in range(len(items))]
    active = np.zeros(engine.config.max_slots, bool)
    active[[slot for slot, _, _ in items]] = True
    for _ in range(steps - 1):
        state, o = engine.step(state, active)
        for i, (slot, _, _) in enumerate(items):
            out[i].append(int(o.tokens[0, slot]))
    return out


@pytest.mark.parametrize("prompt_len", [9, 70], ids=["bucket", "chunked"])
def test_greedy_with_every_penalty_matches_the_teacher_forced_reference(tiny_engine,
                                                                         prompt_len):
    rng = np.random.default_rng(prompt_len)
    prompt = rng.integers(0, 40, prompt_len).tolist()  # a small alphabet: many repeats
    V = tiny_engine.vocab_size
    bias = {int(i): float(rng.uniform(-3, 3)) for i in rng.choice(V, 30, replace=False)}
    stop = (int(rng.integers(V)),)
    breakers = (3, 5)
    slot = SlotSettings(**CONTROLS, logit_bias=tuple(bias.items()), stop_ids=stop,
                        banned_ids=(1, 2), dry_breaker_ids=breakers)
    params = {**CONTROLS, "logit_bias": bias, "stop_ids": stop, "banned_ids": (1, 2),
              "dry_breaker_ids": breakers}
    params["dry_penalty_last_n"] = -1
    got = generate(tiny_engine, [(3, prompt, slot)], STEPS)[0]
    for i in range(STEPS):
        want = reference_next(tiny_engine, prompt + got[:i], len(prompt), params)
        assert got[i] == want, f"token {i}: engine {got[i]}, reference {want}; {got}"


def test_bad_words_never_appear_in_the_output(tiny_engine):
    prompt = [7, 8, 9, 10]
    plain = generate(tiny_engine, [(0, prompt, SlotSettings())], STEPS)[0]
    word = tuple(plain[2:4])  # a two-token sequence greedy decoding produces
    banned = generate(tiny_engine, [(0, prompt, SlotSettings(bad_words=(word,)))], STEPS)[0]
    pairs = {tuple(banned[i:i + 2]) for i in range(len(banned) - 1)}
    assert word not in pairs and banned[:3] == plain[:3]


def test_processed_logprobs_are_the_sampled_distribution():
    R, V = 3, 400
    logits = jax.random.normal(jax.random.key(1), (R, V)) * 2.0
    s = SamplingState.host_defaults(R, V)
    s = dataclasses.replace(
        s, temperature=np.array([0.0, 0.7, 1.0], np.float32),
        top_k=np.array([0, 5, 1], np.int32))
    s.bias_ids[0, 0], s.bias_values[0, 0] = 17, 50.0  # greedy row: biased to token 17
    s = jax.tree.map(jnp.asarray, s)
    history = TokenHistory.zeros(R, 1, V)
    length, steps = jnp.ones((R,), jnp.int32), jnp.zeros((R,), jnp.int32)
    raw = sample(logits, s, history, length, steps, 5, "raw")
    proc = sample(logits, s, history, length, steps, 5, "processed")
    np.testing.assert_array_equal(raw.tokens, proc.tokens)
    assert int(proc.tokens[0]) == 17
    biased = np.asarray(logits[0]).astype(np.float64)
    biased[17] += 50.0
    want0 = biased - np.log(np.exp(biased - biased.max()).sum()) - biased.max()
    np.testing.assert_allclose(proc.top_logprobs[0], np.sort(want0)[::-1][:5], atol=1e-5)
    # top-5 at T=0.7: the five kept tokens hold all the mass.
    assert abs(float(np.exp(np.asarray(proc.top_logprobs[1])).sum()) - 1) < 1e-5
    x1 = np.asarray(logits[1]) / 0.7
    top5 = np.sort(x1)[::-1][:5]
    np.testing.assert_allclose(proc.top_logprobs[1], top5 - np.log(np.exp(top5).sum()),
                               atol=1e-5)
    # top-1: the only kept token has logprob 0, the rest -inf; raw stays the model's.
    assert float(proc.logprobs[2]) == 0.0
    assert np.isneginf(np.asarray(proc.top_logprobs[2, 1:])).all()
    assert float(raw.logprobs[2]) < 0


def test_logprobs_mode_is_validated():
    from metrale_jax.engine import EngineConfig
    from metrale_jax.errors import InvalidParameterError
    with pytest.raises(InvalidParameterError, match="logprobs_mode"):
        EngineConfig(logprobs_mode="cooked")
    assert settings_to_arrays([SlotSettings()], 1, 64).banned.shape == (1, 2)
