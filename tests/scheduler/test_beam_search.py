"""Beam search through the batching loop, against transformers' `generate(num_beams=...)`.

A tiny random Llama; a stop token id joins eos in both (so that hypotheses do end early and
the finished-hypothesis bookkeeping is exercised). Each case compares every returned
hypothesis's ids, and its score, with transformers'.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from metrale_jax import SamplingParams
from metrale_jax.errors import InvalidParameterError
from metrale_jax.scheduler import Finished, GenerationRequest

PROMPTS = [[1, 5, 9, 33, 70, 2, 8], list(range(40, 75)), [3, 4]]
STOP = 410  # a token the tiny model often predicts: some beams stop on it


@pytest.fixture(scope="module")
def beam_setup(tiny_folder):
    """(an LLM with 8 rows, all finishing in one step; the transformers model)."""
    import transformers

    from metrale_jax import LLM
    llm = LLM(tiny_folder, max_slots=8, max_len=128, max_prefill_len=64, max_prefill_batch=8)
    _ = llm.scheduler
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_folder).eval()
    yield llm, hf
    llm.close()


def _reference(hf, ids, eos, **kw) -> tuple[list[list[int]], np.ndarray]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), do_sample=False, pad_token_id=0,
                          eos_token_id=eos, output_scores=True, return_dict_in_generate=True,
                          **kw)
    seqs = []
    for row in out.sequences[:, len(ids):].tolist():
        cut = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
        seqs.append(row[:cut])
    return seqs, out.sequences_scores.numpy()


CASES = [(2, 1.0, False, 0), (4, 0.6, True, 0), (4, 2.0, "never", 0), (5, 1.0, False, 3),
         (3, 2.0, False, 0), (2, 0.6, "never", 2), (5, 1.0, True, 0)]


@pytest.mark.parametrize("width, length_penalty, early_stopping, min_tokens", CASES)
def test_beam_search_equals_transformers(beam_setup, width, length_penalty, early_stopping,
                                         min_tokens):
    llm, hf = beam_setup
    eos = [*llm.scheduler.eos_token_ids, STOP]
    params = SamplingParams(max_tokens=12, num_beams=width, length_penalty=length_penalty,
                            early_stopping=early_stopping, num_return_sequences=width,
                            stop_token_ids=[STOP], min_tokens=min_tokens)
    outs = llm.generate(PROMPTS, params)  # the prompts' searches run side by side
    stopped = 0
    for ids, out in zip(PROMPTS, outs, strict=True):
        want, scores = _reference(hf, ids, eos, num_beams=width, num_return_sequences=width,
                                  length_penalty=length_penalty, early_stopping=early_stopping,
                                  max_new_tokens=12, min_new_tokens=min_tokens)
        assert [list(h.token_ids) for h in out.beams] == want
        np.testing.assert_allclose([h.score for h in out.beams], scores, rtol=1e-5)
        assert list(out.token_ids) == want[0] and out.text == out.beams[0].text
        assert out.finish_reason == out.beams[0].finish_reason
        stopped += sum(h.finish_reason == "stop" for h in out.beams)
        assert all(len(h.token_ids) > min_tokens for h in out.beams)
    if not min_tokens and length_penalty <= 1.0:  # (a penalty > 1 favours long ones)
        assert stopped, "no hypothesis ended on the stop token: the case tests less"


@pytest.mark.accelerator
def test_beams_beside_other_requests_give_their_answer_alone_and_compile_nothing(beam_setup):
    llm, _ = beam_setup
    sched = llm.scheduler
    mixed = [SamplingParams(max_tokens=10, num_beams=2, num_return_sequences=2),
             SamplingParams(max_tokens=10, temperature=0.8, seed=4, ignore_eos=True),
             SamplingParams(max_tokens=8, num_beams=5, length_penalty=0.6),
             SamplingParams(max_tokens=6, temperature=0)]
    prompts = [PROMPTS[i % 3] for i in range(len(mixed))]
    alone = [llm.generate([p], [s])[0] for p, s in zip(prompts, mixed, strict=True)]
    together = llm.generate(prompts, mixed)
    assert [(c.token_ids, c.beams) for c in together] == [(c.token_ids, c.beams)
                                                          for c in alone]
    llm.generate(prompts[:2], [SamplingParams(max_tokens=5, num_beams=3, early_stopping=True),
                               SamplingParams(max_tokens=5, num_beams=4, length_penalty=2.0)])
    # Widths and settings are data: every step program run is one of the grid that warmup
    # compiles (this engine compiles lazily), and the same shapes again compile nothing.
    engine = sched.engine
    steps = {key[1:] for key in engine.programs.compiled_keys() if key[0] == "step"}
    assert steps <= set(engine.program_grid()), steps - set(engine.program_grid())
    compiles = engine.compile_count
    llm.generate(prompts, mixed)
    assert engine.compile_count == compiles
    assert not sched.rows.busy()
    sched.engine.pages.check()


def test_a_cancelled_beam_search_frees_its_rows(beam_setup):
    llm, _ = beam_setup
    sched = llm.scheduler
    handle = sched.submit(GenerationRequest.make(PROMPTS[1], SamplingParams(
        max_tokens=60, num_beams=4, ignore_eos=True)))
    handle.cancel()
    events = list(handle)
    assert not any(isinstance(e, Finished) for e in events)
    llm.generate([PROMPTS[0]], SamplingParams(max_tokens=2))  # a loop pass after the cancel
    assert not sched.rows.busy()
    sched.engine.pages.check()


def test_bad_beam_settings_are_refused(beam_setup):
    llm, _ = beam_setup
    with pytest.raises(InvalidParameterError, match="num_beams must be at most 8"):
        llm.scheduler.submit(GenerationRequest.make([1, 2], SamplingParams(num_beams=9)))
    with pytest.raises(InvalidParameterError, match="num_beams must be at most 6"):  # 2 eos
        llm.scheduler.submit(GenerationRequest.make([1, 2], SamplingParams(
            num_beams=7, stop_token_ids=[STOP])))
    for bad, param in [(dict(num_beams=0), "num_beams"),
                       (dict(num_beams=2, num_return_sequences=3), "num_return_sequences"),
                       (dict(num_beams=2, stop=["x"]), "stop"),
                       (dict(num_beams=2, logprobs=2), "logprobs"),
                       (dict(num_beams=2, presence_penalty=0.5), "presence_penalty"),
                       (dict(num_beams=2, early_stopping="sometimes"), "early_stopping"),
                       (dict(num_beams=2, length_penalty=float("inf")), "length_penalty")]:
        with pytest.raises(InvalidParameterError) as info:
            SamplingParams(**bad)
        assert info.value.param == param


def test_a_beam_search_preempted_by_priority_frees_its_rows_and_gives_its_answer(beam_setup):
    """A 4-wide beam search of priority 5 and four rows of priority 3 fill the 8 rows; an
    arrival of priority -1 preempts the worst (the beam search: all 4 rows freed), which
    waits until the arrival's prompt is in, starts again from its prompt, and answers as
    it does alone."""
    from metrale_jax.completion import collect
    from tests.step_gate import gated
    llm, _ = beam_setup
    sched = llm.scheduler
    beam = SamplingParams(max_tokens=10, num_beams=4, length_penalty=0.6)
    single = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    alone = llm.generate([PROMPTS[0]], beam)[0]
    before = sched.stats["preempted_by_priority"]

    def submit(ids, params, priority):
        return sched.submit(GenerationRequest.make(ids, params, priority=priority))

    with gated(sched.engine) as gate:
        searched = submit(PROMPTS[0], beam, 5)
        assert gate.entered.wait(60)
        others = [submit([7, 8, 9 + i], single, 3) for i in range(4)]
        for _ in range(4):
            gate.next()
        assert sum(s is not None for s in sched.snapshot()["slots"]) == 8
        urgent = submit(PROMPTS[2], SamplingParams(max_tokens=2, temperature=0), -1)
        gate.next()
        held = [s["request_id"] if s else None for s in sched.snapshot()["slots"]]
        assert held.count(None) == 3 and urgent.request_id in held
        assert searched.request_id not in held and sched.snapshot()["waiting"] == 1
        assert sched.stats["preempted_by_priority"] == before + 1
    got = collect(searched)
    assert (got.token_ids, got.beams) == (alone.token_ids, alone.beams)
    assert all(len(collect(h).token_ids) == 20 for h in others)
    assert len(collect(urgent).token_ids) == 2
    assert not sched.rows.busy()
    sched.engine.pages.check()
