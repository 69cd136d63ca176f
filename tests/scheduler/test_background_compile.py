"""Serving before the grid is compiled (`warmup="serve"`): requests that arrive while the rest of
the grid compiles in the background run in the programs already compiled (a larger row bucket,
a smaller chunk limit) and give the same tokens as on an engine that compiled every shape; no
request compiles anything, and once the grid is complete the compile counter stays flat."""

from __future__ import annotations

import threading

import pytest

from metrale_jax import SamplingParams
from metrale_jax.engine.programs import COMPILE_THREAD, ProgramCache

# Prompts of 1 .. 70 tokens (over max_prefill_len=32: chunked), greedy and seeded sampling.
PROMPTS = [[(7 * i + 3 * j) % 500 + 1 for i in range(n)] for j, n in enumerate((1, 9, 40, 70))]
PARAMS = [SamplingParams(max_tokens=10, temperature=0.0 if j % 2 == 0 else 0.9, top_k=40,
                         seed=11 + j, ignore_eos=True) for j in range(len(PROMPTS))]


@pytest.fixture
def gated_background(monkeypatch):
    """The background compile holds until the test opens the gate (one worker): the requests
    sent meanwhile find only the programs compiled before serving."""
    gate = threading.Event()
    original = ProgramCache.warmup_in_background

    def gated(self, jobs, workers=2):
        original(self, [gate.wait, *jobs], 1)

    monkeypatch.setattr(ProgramCache, "warmup_in_background", gated)
    yield gate
    gate.set()


def test_requests_during_the_background_compile_match_a_full_grid(tiny_folder, tiny_llm,
                                                                  gated_background):
    from metrale_jax import LLM
    expected = [c.token_ids for c in tiny_llm.generate(PROMPTS, PARAMS)]  # exact shapes
    llm = LLM(tiny_folder, max_slots=4, max_len=128, max_prefill_len=32, max_prefill_batch=2,
              warmup="serve")
    try:
        engine = llm.scheduler.engine
        first = engine.compile_count
        assert not engine.compile_status()["background"]["complete"]
        cfg = engine.config
        # Only the largest row bucket and the smallest chunk serve now.
        assert engine.chunk_limit == cfg.chunk_buckets[0] < cfg.max_prefill_len
        assert engine.step_programs.decode_rows(1) == cfg.max_slots > cfg.active_slot_buckets[0]
        during = [c.token_ids for c in llm.generate(PROMPTS, PARAMS)]
        alone = [llm.generate([p], sp)[0].token_ids for p, sp in zip(PROMPTS, PARAMS,
                                                                     strict=True)]
        assert engine.compile_count == first  # nothing compiled for the requests
        gated_background.set()
        assert engine.wait_compiled(timeout=600)
        status = engine.compile_status()["background"]
        assert status["complete"] and status["done"] == status["total"] > 0
        full_grid = engine.compile_count
        assert full_grid > first
        assert all(name.startswith(COMPILE_THREAD)
                   for name in engine.programs.compiled_on.values())
        assert engine.chunk_limit == cfg.max_prefill_len
        after = [c.token_ids for c in llm.generate(PROMPTS, PARAMS)]
        assert engine.compile_count == full_grid  # flat once the grid is complete
    finally:
        llm.close()
    assert during == alone == after == expected
