"""The prefix cache through the batching loop: reuse gives the cold prefill's output, tenants
and salts keep apart, the choices of a prompt share it, and the books balance under pressure.

Every test draws prompts no other test uses (its own random tokens), so the session's shared
`tiny_llm` cache only holds what the test put there. A cold run of the same prompt on the same
engine is a run under a `cache_salt` no one else uses: it finds nothing.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading

import numpy as np
import pytest

from metrale_jax import SamplingParams
from metrale_jax.scheduler import Cancelled, Finished, GenerationRequest, TimedOut, Token

PS = 16  # the engine's default page size
MIN = 64  # the engine's default prefix_cache_min_tokens
_cold = itertools.count()


@dataclasses.dataclass
class Run:
    tokens: list[int]
    logprobs: list[float]
    top: list[list[float]]
    cached: int


def _prompt(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, 1000, n).tolist()


def submit(llm, prompt, params, tenant=None, salt=None):
    return llm.scheduler.submit(GenerationRequest.make(prompt, params, tenant=tenant,
                                                       cache_salt=salt))


def collect(handle) -> Run:
    run = Run([], [], [], -1)
    for event in handle:
        if isinstance(event, Token):
            run.tokens.extend(event.token_ids)
            for lp in event.logprobs:
                run.logprobs.append(lp.logprob)
                run.top.append([v for _, v in lp.top])
        elif isinstance(event, Finished):
            run.cached = event.cached_tokens
        else:
            raise AssertionError(f"unexpected end: {event}")
    return run


def run(llm, prompt, params, tenant=None, salt=None) -> Run:
    return collect(submit(llm, prompt, params, tenant, salt))


def cold(llm, prompt, params) -> Run:
    """The prompt prefilled whole: under a salt no other request has."""
    out = run(llm, prompt, params, salt=f"cold-{next(_cold)}")
    assert out.cached == 0
    return out


def same(a: Run, b: Run) -> None:
    assert a.tokens == b.tokens
    np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(a.top, b.top, rtol=1e-4, atol=1e-5)


GREEDY = SamplingParams(max_tokens=8, temperature=0.0, logprobs=5, ignore_eos=True)


def _books_balance(scheduler) -> None:
    pages = scheduler.engine.pages
    pages.check()
    assert pages.free_pages == pages.usable_pages
    assert np.all(pages.refcount[1:] == 0)


# Prompt lengths at the page edges: k pages, one short, one over; a prompt cached but for its
# last token (6 pages + 1); the shortest that shares (4 pages + 1).
@pytest.mark.parametrize("length", [80, 79, 81, 97, 65])
def test_a_reused_prefix_gives_the_cold_prefills_output(tiny_llm, length):
    prompt = _prompt(1000 + length, length)
    reference = cold(tiny_llm, prompt, GREEDY)
    first = run(tiny_llm, prompt, GREEDY)  # fills the cache (public namespace)
    assert first.cached == 0
    again = run(tiny_llm, prompt, GREEDY)
    # Whole pages, and the last prompt token is always computed (its logits give a token).
    assert again.cached == (length - 1) // PS * PS
    same(again, reference)
    same(first, reference)
    # Another prompt with the same first pages reuses them and prefills the rest.
    other = [*prompt[:length - 1], int(prompt[-1]) % 997 + 1, *_prompt(length, 5)]
    hit = run(tiny_llm, other, GREEDY)
    assert hit.cached == (length - 1) // PS * PS
    same(hit, cold(tiny_llm, other, GREEDY))
    _books_balance(tiny_llm.scheduler)


PENALTIES = SamplingParams(max_tokens=24, temperature=0.9, seed=11, repetition_penalty=1.5,
                           presence_penalty=0.8, frequency_penalty=0.6, ignore_eos=True,
                           logprobs=2)


@pytest.mark.parametrize("length", [64, 49, 17, 10])
def test_a_prefix_shorter_than_the_minimum_is_prefilled(tiny_llm, length):
    prompt = _prompt(1500 + length, length)
    run(tiny_llm, prompt, GREEDY)
    assert (length - 1) // PS * PS < MIN
    again = run(tiny_llm, prompt, GREEDY)
    assert again.cached == 0
    same(again, cold(tiny_llm, prompt, GREEDY))


def test_seeded_sampling_with_penalties_is_the_same_with_a_hit(tiny_llm):
    # The prompt repeats a few tokens, so the penalties (which read the prompt's tokens) shape
    # what is sampled: a hit must give the row the shared prefix's token history too.
    prompt = (_prompt(2001, 6) * 12)[:70]
    reference = cold(tiny_llm, prompt, PENALTIES)
    run(tiny_llm, prompt, PENALTIES)
    again = run(tiny_llm, prompt, PENALTIES)
    assert again.cached == 64
    same(again, reference)


def test_batch_invariance_holds_with_hits(tiny_llm):
    base = _prompt(3000, 70)
    run(tiny_llm, base, GREEDY)  # 4 pages cached
    params = [GREEDY, dataclasses.replace(PENALTIES, max_tokens=8),
              SamplingParams(max_tokens=8, temperature=1.0, seed=3, logprobs=3, top_k=50),
              GREEDY]
    prompts = [base[:64] + _prompt(3001 + i, 3 + 7 * i) for i in range(4)]
    alone = [run(tiny_llm, p, sp) for p, sp in zip(prompts, params, strict=True)]
    handles = [submit(tiny_llm, p, sp) for p, sp in zip(prompts, params, strict=True)]
    together = [collect(h) for h in handles]
    for prompt, a, t in zip(prompts, alone, together, strict=True):
        # Alone, a prompt finds the base's pages; together, also its own from its alone run.
        assert a.cached == 64 and t.cached == (len(prompt) - 1) // PS * PS
        same(a, t)


def test_tenants_and_salts_never_share(tiny_llm):
    stats = tiny_llm.scheduler.stats
    prompt = _prompt(4000, 70)
    assert run(tiny_llm, prompt, GREEDY, tenant="a").cached == 0
    hits = stats["prefix_cache_hits"]
    queries = stats["prefix_cache_queries"]
    assert run(tiny_llm, prompt, GREEDY, tenant="b").cached == 0
    assert run(tiny_llm, prompt, GREEDY).cached == 0  # the public namespace
    assert stats["prefix_cache_hits"] == hits  # nothing found
    assert stats["prefix_cache_queries"] == queries + 2 * len(prompt)
    assert run(tiny_llm, prompt, GREEDY, tenant="a", salt="x").cached == 0
    assert run(tiny_llm, prompt, GREEDY, tenant="a").cached == 64
    assert run(tiny_llm, prompt, GREEDY, tenant="a", salt="x").cached == 64
    assert run(tiny_llm, prompt, GREEDY, tenant="a", salt="y").cached == 0
    assert stats["prefix_cache_hits"] == hits + 128


def test_the_choices_of_a_prompt_prefill_it_once(tiny_llm):
    prompt = _prompt(5000, 70)
    hits = tiny_llm.scheduler.stats["prefix_cache_hits"]
    params = [dataclasses.replace(PENALTIES, seed=i, max_tokens=6) for i in range(3)]
    handles = [submit(tiny_llm, prompt, sp) for sp in params]  # queued together
    runs = [collect(h) for h in handles]
    # The first choice prefills the prompt; the others share its pages (written in the same
    # steps) and prefill only the last partial page.
    assert [r.cached for r in runs] == [0, 64, 64]
    assert tiny_llm.scheduler.stats["prefix_cache_hits"] == hits + 128
    for sp, r in zip(params, runs, strict=True):
        same(r, cold(tiny_llm, prompt, sp))


def test_generated_pages_are_cached_for_the_next_turn(tiny_llm):
    prompt = _prompt(6000, 20)
    first = run(tiny_llm, prompt, dataclasses.replace(GREEDY, max_tokens=60))
    # The next turn's prompt is this one plus the answer plus more: it finds the pages the
    # answer's decoding filled, not only the prompt's.
    turn = prompt + first.tokens + _prompt(6001, 9)
    hit = run(tiny_llm, turn, GREEDY)
    # (The answer's last token is in the pages too when the loop, one step ahead, fed it.)
    assert hit.cached % PS == 0 and hit.cached >= (len(prompt) + len(first.tokens) - 1) // PS * PS
    assert hit.cached <= len(prompt) + len(first.tokens)
    same(hit, cold(tiny_llm, turn, GREEDY))


def test_a_small_pool_evicts_idle_pages_and_every_request_finishes(small_pool_llm):
    """Seven usable pages: the cache must give way to running requests, never take a page in
    use, and end with every reference back."""
    sched = small_pool_llm.scheduler
    base = _prompt(7000, 40)
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    prompts = [base + _prompt(7001 + i, 5 + 11 * i) for i in range(5)]
    handles = [submit(small_pool_llm, p, params) for p in prompts]
    ends = [list(h)[-1] for h in handles]
    assert all(isinstance(e, Finished) and e.completion_tokens == 20 for e in ends)
    _books_balance(sched)
    assert sched.engine.pages.idle_pages > 0  # what was cached stays until evicted


@pytest.mark.parametrize("seed", range(3))
def test_random_mixes_keep_the_books(small_pool_llm, seed):
    """Shared prefixes, cancellations, deadlines and preemptions in a small pool, at random:
    every request ends, the page books check out after every stage, all references return."""
    sched = small_pool_llm.scheduler
    rng = np.random.default_rng(8000 + seed)
    bases = [_prompt(8100 + 10 * seed + b, int(rng.integers(10, 50))) for b in range(3)]
    handles, cancel_after = [], []
    for j in range(14):
        base = bases[int(rng.integers(0, 3))]
        prompt = base[:int(rng.integers(1, len(base) + 1))] + _prompt(
            9000 + 100 * seed + j, int(rng.integers(0, 20)))
        sp = SamplingParams(max_tokens=int(rng.integers(1, 40)), ignore_eos=True,
                            temperature=float(rng.choice([0.0, 0.8])), seed=j)
        timeout = 0.001 if rng.random() < 0.1 else None
        handles.append(sched.submit(GenerationRequest.make(
            prompt, sp, timeout=timeout, tenant=str(rng.integers(0, 2)))))
        cancel_after.append(int(rng.integers(1, 6)) if rng.random() < 0.3 else None)
    ends = []

    def drain(h, after):
        seen = 0
        for event in h:
            if isinstance(event, Token):
                seen += 1
                if after is not None and seen == after:
                    h.cancel()
        ends.append(event)

    threads = [threading.Thread(target=drain, args=(h, a))
               for h, a in zip(handles, cancel_after, strict=True)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(ends) == len(handles)
    assert all(isinstance(e, Finished | Cancelled | TimedOut) for e in ends)
    _books_balance(sched)
