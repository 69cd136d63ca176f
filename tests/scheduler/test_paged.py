"""Paged KV under pressure: preemption, page accounting and prompts that ride along decoding."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from metrale_jax import SamplingParams
from metrale_jax.errors import ContextLengthError
from metrale_jax.scheduler import Cancelled, GenerationRequest, TimedOut, Token

PARAMS = [SamplingParams(max_tokens=40, temperature=0.0 if j % 2 == 0 else 0.9, seed=50 + j,
                         frequency_penalty=0.5 * (j % 3), repetition_penalty=1.0 + 0.2 * (j % 2),
                         ignore_eos=True) for j in range(6)]
PROMPTS = [[(13 * i + 7 * j) % 1000 for i in range(5 + 9 * j)] for j in range(6)]


def _all_pages_back(scheduler) -> None:
    pages = scheduler.engine.pages
    pages.check()
    assert pages.free_pages == pages.usable_pages


def test_a_small_pool_preempts_and_gives_the_same_tokens(small_pool_llm, tiny_llm):
    big = tiny_llm.generate(PROMPTS, PARAMS)
    small = small_pool_llm.generate(PROMPTS, PARAMS)
    assert small_pool_llm.scheduler.stats["preempted"] > 0
    assert [c.token_ids for c in small] == [c.token_ids for c in big]
    assert all(c.finish_reason == "length" and len(c.token_ids) == 40 for c in small)
    _all_pages_back(small_pool_llm.scheduler)
    _all_pages_back(tiny_llm.scheduler)


def test_a_request_larger_than_the_pool_is_refused(small_pool_llm):
    sched = small_pool_llm.scheduler
    with pytest.raises(ContextLengthError, match="KV cache holds 112 tokens"):
        sched.submit(GenerationRequest.make([1] * 100, SamplingParams(max_tokens=20)))


def test_every_page_returns_after_a_mix_of_endings(small_pool_llm):
    sched = small_pool_llm.scheduler
    rng = np.random.default_rng(0)
    handles, ends = [], []
    for j in range(12):
        ids = rng.integers(0, 1000, int(rng.integers(1, 60))).tolist()
        sp = SamplingParams(max_tokens=int(rng.integers(1, 50)), temperature=0.8, seed=j,
                            ignore_eos=True)
        timeout = 0.0 if j % 5 == 4 else None
        handles.append(sched.submit(GenerationRequest.make(ids, sp, timeout=timeout)))
    for j, h in enumerate(handles):
        if j % 4 == 1:
            h.cancel()

    def drain(h):
        ends.append(list(h)[-1])
    threads = [threading.Thread(target=drain, args=(h,)) for h in handles]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(ends) == 12
    assert any(isinstance(e, Cancelled) for e in ends)
    assert any(isinstance(e, TimedOut) for e in ends)
    # The loop frees a slot when it reads the end: wait until it is idle again.
    done = small_pool_llm.generate([[1, 2]], SamplingParams(max_tokens=1))[0]
    assert len(done.token_ids) == 1
    _all_pages_back(sched)


def test_a_long_prompt_rides_along_without_stopping_a_stream(tiny_llm):
    """While a 90-token prompt is prefilled in pieces of at most 32 tokens, a stream already
    decoding gets a token every step: no step of the loop runs the prompt alone. A 30-token
    prompt behind it fills the chunks its later, shorter pieces leave."""
    sched = tiny_llm.scheduler
    engine = sched.engine
    calls: list[tuple[int, int]] = []  # (decoding rows, prompt tokens) of each step
    steps: list[list[tuple[int, int, bool]]] = []  # each step's (start, tokens, finishing)
    real = engine.step

    def spy(state, active=None, allowed=None, pieces=()):
        calls.append((int(np.sum(active)) if active is not None else -1,
                      sum(len(p.tokens) for p in pieces)))
        steps.append([(p.start, len(p.tokens), p.settings is not None) for p in pieces])
        return real(state, active, allowed, pieces)

    sp = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    stream = sched.submit(GenerationRequest.make([1, 2, 3], sp))
    events = iter(stream)
    long_ids, short_ids = list(range(5, 95)), list(range(200, 230))
    try:
        assert isinstance(next(events), Token)
        engine.step = spy  # from here on: the stream decodes, the long prompt arrives
        long = sched.submit(GenerationRequest.make(long_ids, sp))
        short = sched.submit(GenerationRequest.make(short_ids, sp))
        long_tokens = [e for e in long if isinstance(e, Token)]
        short_tokens = [e for e in short if isinstance(e, Token)]
        rest = [e for e in events if isinstance(e, Token)]
    finally:
        del engine.step
    assert sum(len(e.token_ids) for e in long_tokens) == 30
    assert sum(len(e.token_ids) for e in rest) == 29
    with_prompt = [c for c in calls if c[1] > 0]
    assert sum(c[1] for c in with_prompt) == 120  # both prompts, in pieces
    assert len(with_prompt) >= 4  # 120 tokens under a 32-token budget
    assert all(c[0] >= 1 for c in with_prompt)  # the stream decoded in each of them
    # Each chunk fills a bucket exactly (the last pieces cut to fit): only a tail shorter
    # than the smallest bucket is padded.
    buckets = engine.config.chunk_buckets
    assert all(c[1] in buckets or c[1] < buckets[0] for c in with_prompt), (buckets, calls)
    # A later piece shrinks as the context before it grows (engine/step_cost.py): its cost
    # stays within the step's budget, and here the limit binds: some piece starts where
    # less than the largest bucket is allowed.
    cost = engine.step_cost
    later = [(start, size) for step in steps for start, size, _ in step if start]
    assert all(cost.piece_flops(size, start) <= cost.budget for start, size in later), steps
    assert any(cost.chunk_limit(start) < buckets[-1] for start, _ in later), steps
    # The short prompt fills what a limited later piece leaves: a step with a continuing
    # piece carries another prompt's piece too.
    assert any(len(step) >= 2 and step[0][0] > 0 and step[0][1] < buckets[-1]
               for step in steps), steps
    alone = tiny_llm.generate([long_ids, short_ids], sp)
    assert [t for e in long_tokens for t in e.token_ids] == list(alone[0].token_ids)
    assert [t for e in short_tokens for t in e.token_ids] == list(alone[1].token_ids)


def test_a_request_that_ended_reads_as_gone_before_its_last_event(tiny_llm, monkeypatch):
    """The loop frees a request's row, then posts its last event: held just after that post,
    the snapshot (what /v1/metrale/stats and /metrics read) already shows the slot free (it
    would show it used if the row were freed after the post)."""
    from metrale_jax.scheduler import Finished
    from metrale_jax.scheduler.request import RequestHandle
    sched = tiny_llm.scheduler
    posted, release = threading.Event(), threading.Event()
    real = RequestHandle.post

    def held(self, event):
        real(self, event)
        if isinstance(event, Finished):
            posted.set()
            release.wait(60)  # the loop waits here until the test has looked

    monkeypatch.setattr(RequestHandle, "post", held)
    try:
        handle = sched.submit(GenerationRequest.make([1, 2, 3], SamplingParams(max_tokens=2)))
        assert isinstance(list(handle)[-1], Finished)
        assert posted.is_set()  # the loop is held just after the last event
        assert all(s is None for s in sched.snapshot()["slots"])
    finally:
        release.set()
