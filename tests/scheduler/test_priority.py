"""Request priorities: the waiting queue's order and preemption by priority.

The loop tests hold the engine inside its step (tests/step_gate.py), queue requests while it
is held, then let steps through one at a time: `snapshot()` shows who holds each slot after
each admission round. No timing decides anything. A preempted request is recomputed: its
tokens must be exactly those of the same request run alone (greedy and seeded). The queue
itself (scheduler/waiting.py) is tested alone at the end.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from metrale_jax import SamplingParams
from metrale_jax.completion import collect
from metrale_jax.errors import InvalidParameterError
from metrale_jax.scheduler import GenerationRequest
from metrale_jax.scheduler.waiting import PRIORITY_MAX, PRIORITY_MIN, WaitingQueue, check_priority
from tests.step_gate import StepGate, gated

LONG = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
SHORT = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)


def _prompt(seed: int, n: int = 12) -> list[int]:
    return np.random.default_rng(seed).integers(3, 1000, n).tolist()


def _submit(llm, rid: str, priority: int, params=SHORT, seed: int = 0, n: int = 12,
            tenant: str | None = None):
    return llm.scheduler.submit(GenerationRequest.make(
        _prompt(seed, n), params, request_id=rid, priority=priority, tenant=tenant))


def _slots(llm) -> list[str | None]:
    return [s["request_id"] if s else None for s in llm.scheduler.snapshot()["slots"]]


def _step_until(gate: StepGate, cond, rounds: int = 200) -> bool:
    for _ in range(rounds):
        gate.next()
        if cond():
            return True
    return False


def _alone(llm, seed: int, params, n: int = 12) -> list[int]:
    return llm.generate([_prompt(seed, n)], params)[0].token_ids


def test_the_lowest_priority_value_is_admitted_first(tiny_llm):
    """Six requests queue while one row runs: the next round fills the three free rows with
    the three lowest values, equal values in arrival order; nothing is preempted for an
    equal priority (the fourth 0 waits though a 0 runs)."""
    stats = tiny_llm.scheduler.stats
    before = stats["preempted_by_priority"]
    with gated(tiny_llm.scheduler.engine) as gate:
        first = _submit(tiny_llm, "prio-x", 0, LONG)
        assert gate.entered.wait(60)
        queued = [_submit(tiny_llm, rid, p, LONG, seed=i + 1) for i, (rid, p) in enumerate(
            [("prio-5", 5), ("prio-0a", 0), ("prio-m1", -1), ("prio-0b", 0), ("prio-m2", -2),
             ("prio-0c", 0)])]
        gate.next()
        assert _slots(tiny_llm) == ["prio-x", "prio-m2", "prio-m1", "prio-0a"]
        assert tiny_llm.scheduler.snapshot()["waiting"] == 3
        first.cancel()  # a free row: 0b (arrived before 0c; 5 last)
        assert _step_until(gate, lambda: _slots(tiny_llm)[0] not in ("prio-x", None))
        assert _slots(tiny_llm)[0] == "prio-0b"
        assert stats["preempted_by_priority"] == before
        for h in queued:
            h.cancel()
    for h in [first, *queued]:
        list(h)


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=30, temperature=0, ignore_eos=True),
    SamplingParams(max_tokens=30, temperature=1.0, top_k=50, seed=7, ignore_eos=True)],
    ids=["greedy", "seeded"])
def test_a_better_priority_preempts_the_worst_row_and_its_tokens_come_back(tiny_llm, params):
    """Four rows run priority 5 (and one 3); an arrival at -1 takes the most recently
    admitted row of the worst value; that request goes back to the queue and, once the
    arrival's prompt is in, is recomputed: its tokens are those it gets alone."""
    sched = tiny_llm.scheduler
    before = sched.stats["preempted_by_priority"]
    with gated(sched.engine) as gate:
        keep = _submit(tiny_llm, "pre-3", 3, params, seed=11)
        assert gate.entered.wait(60)
        low = [_submit(tiny_llm, f"pre-5{i}", 5, params, seed=20 + i) for i in range(3)]
        gate.next()
        assert _slots(tiny_llm) == ["pre-3", "pre-50", "pre-51", "pre-52"]
        assert _step_until(gate, lambda: all(
            s and s["tokens"] >= 5 for s in sched.snapshot()["slots"]))
        urgent = _submit(tiny_llm, "pre-urgent", -1, SHORT, seed=99)
        gate.next()
        slots = _slots(tiny_llm)
        assert "pre-urgent" in slots and "pre-52" not in slots  # the newest of the worst
        assert slots.count(None) == 0 and "pre-3" in slots
        assert sched.stats["preempted_by_priority"] == before + 1
        # it does not take the row back ahead of the one it made room for
        assert sched.snapshot()["waiting"] == 1
    done = [collect(h) for h in [keep, *low, urgent]]
    assert sched.stats["preempted_by_priority"] == before + 1
    assert [len(c.token_ids) for c in done] == [30, 30, 30, 30, 2]
    assert done[3].token_ids == _alone(tiny_llm, 22, params)
    assert done[0].token_ids == _alone(tiny_llm, 11, params)


def test_a_stalled_prompt_of_a_better_priority_takes_pages_from_a_worse_row(small_pool_llm):
    """The pool (7 pages of 16) is held by a priority-5 request when a priority-0 prompt is
    admitted into a free row: its prompt cannot get a page, so the worse row is preempted
    (recompute) and the better prompt prefills; both end with the tokens they get alone."""
    sched = small_pool_llm.scheduler
    params = SamplingParams(max_tokens=95, temperature=1.0, seed=3, ignore_eos=True)
    before = sched.stats["preempted_by_priority"]
    with gated(sched.engine) as gate:
        low = _submit(small_pool_llm, "pool-low", 5, params, seed=5)
        assert gate.entered.wait(60)
        assert _step_until(gate, lambda: sched.engine.pages.free_pages == 0, rounds=300)
        high = _submit(small_pool_llm, "pool-high", 0, SHORT, seed=6, n=40)
        assert _step_until(gate, lambda: sched.stats["preempted_by_priority"] > before)
        assert sched.snapshot()["waiting"] == 1  # pool-low, back in the queue
        assert "pool-high" in _slots(small_pool_llm)
    got_low, got_high = collect(low), collect(high)
    assert sched.stats["preempted_by_priority"] == before + 1
    assert got_high.token_ids == _alone(small_pool_llm, 6, SHORT, n=40)
    assert got_low.token_ids == _alone(small_pool_llm, 5, params)


def test_generate_takes_a_priority_per_prompt_and_refuses_bad_ones(tiny_llm):
    out = tiny_llm.generate([_prompt(1), _prompt(2)], SHORT, priority=[3, -3])
    assert [len(c.token_ids) for c in out] == [2, 2]
    assert tiny_llm.generate(_prompt(1), SHORT, priority=3)[0].token_ids == out[0].token_ids
    for bad in (1.5, True, "1", PRIORITY_MAX + 1, PRIORITY_MIN - 1):
        with pytest.raises(InvalidParameterError, match="priority"):
            tiny_llm.generate(_prompt(1), SHORT, priority=bad)
    with pytest.raises(InvalidParameterError, match="one priority per prompt"):
        tiny_llm.generate([_prompt(1), _prompt(2)], SHORT, priority=[1])


# ---- the queue alone ------------------------------------------------------------------------
def _seq(rid: str, tenant: str | None, priority: int = 0, share: int | None = None):
    request = SimpleNamespace(request_id=rid, tenant=tenant, tenant_slots=share,
                              priority=priority, params=SimpleNamespace(num_beams=1))
    return SimpleNamespace(request=request)


def _drain(q: WaitingQueue, held=None) -> list[str]:
    held = dict(held or {})
    out = []
    while (seq := q.take(100, lambda t: held.get(t, 0))) is not None:
        held[seq.request.tenant] = held.get(seq.request.tenant, 0) + 1
        out.append(seq.request.request_id)
    return out


def test_queue_orders_by_priority_then_fifo_then_round_robin():
    q = WaitingQueue()
    for rid, tenant, p in [("a0", "a", 0), ("a1", "a", -1), ("a2", "a", 0), ("b0", "b", 0),
                           ("b1", "b", 2), ("c0", "c", -1), ("a3", "a", -1)]:
        q.append(_seq(rid, tenant, p))
    assert [s.request.request_id for s in q] == ["a1", "a3", "a0", "a2", "b0", "b1", "c0"]
    # -1s first: a's (its turn), then c's, then a's second; the 0s round-robin, b last
    assert _drain(q) == ["a1", "c0", "a3", "b0", "a0", "a2", "b1"]


def test_queue_priorities_stay_within_the_shares():
    q = WaitingQueue()
    q.append(_seq("a0", "a", -5, share=1))
    q.append(_seq("a1", "a", -5, share=1))
    q.append(_seq("b0", "b", 3))
    # a holds its share: b's worse request goes first, a's better ones wait
    assert _drain(q, held={"a": 1}) == ["b0"]
    assert q.peek(lambda t: 1) is None
    # a preempted request goes first among its priority, not ahead of better ones
    q.append(_seq("a-best", "a", -9, share=1))
    q.appendleft(_seq("a-back", "a", -5, share=1))
    assert _drain(q) == ["a-best"]  # then a is at its share again
    assert [s.request.request_id for s in q] == ["a-back", "a0", "a1"]
    # a blocked head passes its tenant over
    q.append(_seq("c0", "c", 0))
    assert q.take(1, lambda t: 0, lambda s: s.request.tenant == "a").request.request_id == "c0"


def test_check_priority():
    assert check_priority(-7) == -7 and check_priority(PRIORITY_MAX) == PRIORITY_MAX
    for bad in (0.0, False, None, "0", PRIORITY_MIN - 1):
        with pytest.raises(InvalidParameterError):
            check_priority(bad)
