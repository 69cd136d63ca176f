"""The batching loop on a tiny model: tokens, batch invariance, stops, cancellation, errors."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from metrale_jax import SamplingParams
from metrale_jax.errors import BusyError, ContextLengthError, InvalidParameterError
from metrale_jax.scheduler import (
    Cancelled,
    Failed,
    Finished,
    GenerationRequest,
    Scheduler,
    TimedOut,
    Token,
)

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def hf_greedy(folder, ids, n):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                             min_new_tokens=n, pad_token_id=0)
    return out[0, len(ids):].tolist()


def test_greedy_equals_transformers(tiny_llm, tiny_folder):
    for n_prompt in (1, 17, 40):  # 40 > max_prefill_len=32: chunked prefill
        ids = [(7 * i + 3) % 1000 for i in range(n_prompt)]
        got = tiny_llm.generate([ids], GREEDY)[0]
        assert list(got.token_ids) == hf_greedy(tiny_folder, ids, 24), n_prompt
        assert got.finish_reason == "length"


@pytest.mark.accelerator
def test_batch_invariance(tiny_llm):
    prompts = [[(11 * i + j) % 1000 for i in range(3 + 5 * j)] for j in range(8)]
    params = [SamplingParams(max_tokens=12, temperature=0.0 if j % 3 == 0 else 0.7 + 0.1 * j,
                             top_k=[0, 5, 40][j % 3], top_p=[1.0, 0.9][j % 2], seed=100 + j,
                             ignore_eos=True) for j in range(8)]
    together = tiny_llm.generate(prompts, params)
    alone = [tiny_llm.generate([p], sp)[0] for p, sp in zip(prompts, params, strict=True)]
    assert [c.token_ids for c in together] == [c.token_ids for c in alone]


def test_seeded_sampling_repeats_and_seeds_differ(tiny_llm):
    sp = SamplingParams(max_tokens=16, temperature=1.0, seed=7, ignore_eos=True)
    a = tiny_llm.generate([[5, 6, 7]], sp)[0].token_ids
    b = tiny_llm.generate([[5, 6, 7]], sp)[0].token_ids
    c = tiny_llm.generate([[5, 6, 7]], SamplingParams(max_tokens=16, temperature=1.0,
                                                      seed=8, ignore_eos=True))[0].token_ids
    assert a == b
    assert a != c


def test_text_is_the_decoded_tokens(tiny_llm):
    out = tiny_llm.generate(["The quick brown"], SamplingParams(max_tokens=20, temperature=0,
                                                               ignore_eos=True))[0]
    assert out.text == tiny_llm.tokenizer.decode(list(out.token_ids), skip_special_tokens=True)


def test_stop_string_cuts_text(tiny_llm):
    full = tiny_llm.generate(["fox"], SamplingParams(max_tokens=20, temperature=0,
                                                     ignore_eos=True))[0]
    assert len(full.text) > 4
    stop = full.text[2:4]
    cut = tiny_llm.generate(["fox"], SamplingParams(max_tokens=20, temperature=0, stop=[stop],
                                                    ignore_eos=True))[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.text == full.text[: full.text.find(stop)]


def test_stop_token_id(tiny_llm):
    full = tiny_llm.generate([[1, 2, 3]], GREEDY)[0]
    target = full.token_ids[5]
    cut = tiny_llm.generate([[1, 2, 3]], SamplingParams(
        max_tokens=24, temperature=0, stop_token_ids=[target], ignore_eos=True))[0]
    first = full.token_ids.index(target)
    assert cut.token_ids == full.token_ids[: first + 1]
    assert cut.finish_reason == "stop" and cut.stop_reason == target


def test_eos_ends_unless_ignored(tiny_llm):
    full = tiny_llm.generate([[9, 9]], GREEDY)[0]
    eos = full.token_ids[3]
    sched = tiny_llm.scheduler
    old = sched.eos_token_ids
    sched.eos_token_ids = (eos,)
    try:
        p = SamplingParams(max_tokens=24, temperature=0)
        cut = tiny_llm.generate([[9, 9]], p)[0]
        kept = tiny_llm.generate([[9, 9]], SamplingParams(max_tokens=24, temperature=0,
                                                          ignore_eos=True))[0]
    finally:
        sched.eos_token_ids = old
    assert cut.finish_reason == "stop" and cut.token_ids[-1] == eos
    assert len(cut.token_ids) == full.token_ids.index(eos) + 1
    assert kept.token_ids == full.token_ids


def test_too_long_states_both_numbers(tiny_llm):
    with pytest.raises(ContextLengthError, match=r"128.*120 prompt tokens.*max_tokens=20"):
        tiny_llm.generate([[1] * 120], SamplingParams(max_tokens=20))


def test_bad_sampling_values_name_the_parameter():
    for kwargs, name in [({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"),
                         ({"top_k": -2}, "top_k"), ({"min_p": 2}, "min_p"),
                         ({"max_tokens": 0}, "max_tokens"), ({"logprobs": 21}, "logprobs"),
                         ({"seed": "x"}, "seed")]:
        with pytest.raises(InvalidParameterError) as e:
            SamplingParams(**kwargs)
        assert e.value.param == name


def test_logprobs_are_returned(tiny_llm):
    out = tiny_llm.generate([[4, 5]], SamplingParams(max_tokens=5, temperature=0, logprobs=3,
                                                     ignore_eos=True))[0]
    assert len(out.logprobs) == 5
    for entry, tok in zip(out.logprobs, out.token_ids, strict=True):
        assert entry.token_id == tok and entry.logprob <= 0
        assert len(entry.top) == 3 and entry.top[0][0] == tok  # greedy: the top token


def test_cancel_frees_the_slot(tiny_llm):
    sched = tiny_llm.scheduler
    long = SamplingParams(max_tokens=100, temperature=0, ignore_eos=True)
    handles = [sched.submit(GenerationRequest.make([1, 2, 3], long)) for _ in range(4)]
    first = next(iter(handles[0]))
    assert isinstance(first, Token)
    for h in handles:
        h.cancel()
    ends = [list(h)[-1] for h in handles]
    assert all(isinstance(e, (Cancelled, Finished)) for e in ends)
    assert isinstance(ends[0], Cancelled)
    # All slots are free again: four short requests run at once.
    quick = tiny_llm.generate([[1]] * 4, SamplingParams(max_tokens=2, temperature=0,
                                                        ignore_eos=True))
    assert all(len(c.token_ids) == 2 for c in quick)


def test_deadline_times_out(tiny_llm):
    sched = tiny_llm.scheduler
    h = sched.submit(GenerationRequest.make([1, 2], SamplingParams(
        max_tokens=100, temperature=0, ignore_eos=True), timeout=0.0))
    assert isinstance(list(h)[-1], TimedOut)


def test_async_iteration(tiny_llm):
    sched = tiny_llm.scheduler

    async def run():
        loop = asyncio.get_running_loop()
        h = sched.submit(GenerationRequest.make([3, 4], SamplingParams(
            max_tokens=6, temperature=0, ignore_eos=True)), loop=loop)
        return [e async for e in h]

    events = asyncio.run(run())
    assert sum(len(e.token_ids) for e in events if isinstance(e, Token)) == 6
    assert isinstance(events[-1], Finished)


def test_full_queue_is_busy_and_stop_ends_every_stream(tiny_llm):
    ckpt = tiny_llm.checkpoint
    engine = tiny_llm.scheduler.engine
    sched = Scheduler(engine, ckpt.tokenizer, max_waiting=2, warmup=False)
    sched.wait_ready()
    gate = threading.Event()
    real_step = engine.step

    def slow_step(state, *args, **kwargs):
        gate.wait(10)
        return real_step(state, *args, **kwargs)

    class Slow:
        """A view of the engine whose step waits for the test's gate."""

        def __getattr__(self, name):
            return getattr(engine, name)

    sched.engine = Slow()
    sched.engine.step = slow_step
    long = SamplingParams(max_tokens=100, temperature=0, ignore_eos=True)
    handles = []
    with pytest.raises(BusyError):
        for _ in range(50):
            handles.append(sched.submit(GenerationRequest.make([1, 2], long)))
    gate.set()
    sched.stop()
    for h in handles:
        assert isinstance(list(h)[-1], (Cancelled, Finished))


def test_loop_survives_an_engine_error(tiny_llm):
    sched = tiny_llm.scheduler
    engine = sched.engine
    real = engine.step
    calls = {"n": 0}

    def broken(state, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected failure")
        return real(state, *args, **kwargs)

    engine.step = broken
    try:
        h = sched.submit(GenerationRequest.make([1, 2], GREEDY))
        end = list(h)[-1]
    finally:
        engine.step = real
    assert isinstance(end, Failed) and "injected" in str(end.error)
    again = tiny_llm.generate([[1, 2]], GREEDY)[0]
    assert len(again.token_ids) == 24
