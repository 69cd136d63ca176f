"""Multi-step decode (k decode steps per compiled call) gives exactly the single-step tokens."""

from __future__ import annotations

import pytest

from metrale_jax import LLM, SamplingParams


@pytest.fixture(scope="module")
def multistep_llm(tiny_folder):
    llm = LLM(tiny_folder, max_slots=2, max_len=128, max_prefill_len=32, decode_steps=3)
    yield llm
    llm.close()


def test_multistep_equals_single_step(multistep_llm, tiny_llm):
    prompts = [[5, 6, 7, 8], [(3 * i) % 500 for i in range(20)]]
    for max_tokens in (1, 7, 12):  # not multiples of k: the extra steps are dropped
        greedy = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        seeded = SamplingParams(max_tokens=max_tokens, temperature=0.9, seed=3, ignore_eos=True)
        for params in (greedy, seeded):
            want = [c.token_ids for c in tiny_llm.generate(prompts, params)]
            got = [c.token_ids for c in multistep_llm.generate(prompts, params)]
            assert got == want
            assert all(len(t) == max_tokens for t in got)


def test_multistep_stop_string_mid_call(multistep_llm, tiny_llm):
    base = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    full = tiny_llm.generate(["quick brown"], base)[0]
    stop = full.text[3:5]
    p = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, stop=[stop])
    a = tiny_llm.generate(["quick brown"], p)[0]
    b = multistep_llm.generate(["quick brown"], p)[0]
    assert (a.text, a.token_ids, a.finish_reason) == (b.text, b.token_ids, b.finish_reason)
