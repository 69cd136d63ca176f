"""Fair admission: round-robin across tenants, FIFO within one, a tenant's share of the slots.

The loop tests hold the engine inside its step (tests/step_gate.py), queue requests while
it is held, then let exactly one step through: the loop admits one round into the free
slots and stops in the next step, where `snapshot()` shows who was admitted, in slot
(admission) order. No timing decides anything. The queue itself (scheduler/waiting.py) is
also tested alone.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from metrale_jax import SamplingParams
from metrale_jax.scheduler import GenerationRequest
from metrale_jax.scheduler.waiting import WaitingQueue
from tests.step_gate import StepGate, gated

LONG = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
SHORT = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)


def _prompt(seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, 1000, 12).tolist()


def _submit(llm, rid: str, tenant: str | None, params=SHORT, share: int | None = None,
            seed: int = 0):
    return llm.scheduler.submit(GenerationRequest.make(
        _prompt(seed), params, request_id=rid, tenant=tenant, tenant_slots=share))


def _slots(llm) -> list[str | None]:
    return [s["request_id"] if s else None for s in llm.scheduler.snapshot()["slots"]]


def _finish(handles) -> None:
    for h in handles:
        for _ in h:
            pass


def test_a_burst_of_one_tenant_does_not_delay_another(tiny_llm):
    """Tenant a has 64 requests queued when tenant b's one arrives: b is admitted in the
    very next admission round, between a's first two (FIFO within a)."""
    assert tiny_llm.scheduler.num_slots == 4
    with gated(tiny_llm.scheduler.engine) as gate:
        first = _submit(tiny_llm, "fair-x", "a", LONG)
        assert gate.entered.wait(60)  # fair-x holds slot 0; the loop is inside its step
        burst = [_submit(tiny_llm, f"fair-a{i}", "a", seed=i + 1) for i in range(64)]
        lone = _submit(tiny_llm, "fair-b0", "b", seed=99)
        snap = tiny_llm.scheduler.snapshot()
        assert snap["waiting"] == 65 and snap["waiting_by_tenant"] == {"a": 64, "b": 1}
        gate.next()  # one admission round, then held in the next step
        assert _slots(tiny_llm) == ["fair-x", "fair-a0", "fair-b0", "fair-a1"]
        tenants = [s["tenant"] for s in tiny_llm.scheduler.snapshot()["slots"]]
        assert tenants == ["a", "a", "b", "a"]
        for h in burst[2:]:
            h.cancel()
        first.cancel()
    _finish([first, lone, *burst])


def test_single_tenant_admission_stays_fifo(tiny_llm):
    with gated(tiny_llm.scheduler.engine) as gate:
        first = _submit(tiny_llm, "fifo-x", None, LONG)
        assert gate.entered.wait(60)
        rest = [_submit(tiny_llm, f"fifo-{i}", None, seed=i + 1) for i in range(5)]
        gate.next()
        assert _slots(tiny_llm) == ["fifo-x", "fifo-0", "fifo-1", "fifo-2"]
        first.cancel()
    _finish([first, *rest])


def test_a_tenant_at_its_share_waits_while_others_are_admitted(tiny_llm):
    """Tenant a may hold 2 of the 4 slots: with one running and ten queued it gets one more
    slot, tenant b the other two; a's next request is admitted once a slot of a's frees."""
    with gated(tiny_llm.scheduler.engine) as gate:
        first = _submit(tiny_llm, "share-x", "a", LONG, share=2)
        assert gate.entered.wait(60)
        a = [_submit(tiny_llm, f"share-a{i}", "a", LONG, share=2, seed=i + 1)
             for i in range(10)]
        b = [_submit(tiny_llm, f"share-b{i}", "b", LONG, seed=50 + i) for i in range(2)]
        gate.next()
        assert _slots(tiny_llm) == ["share-x", "share-a0", "share-b0", "share-b1"]
        first.cancel()  # frees a's slot 0: the next round gives it to a1, a's next
        assert _wait_for(gate, tiny_llm, lambda slots: slots[0] is not None
                         and slots[0] != "share-x")
        assert _slots(tiny_llm)[0] == "share-a1"
        for h in [*a, *b]:
            h.cancel()
    _finish([first, *a, *b])


def _wait_for(gate: StepGate, llm, cond, rounds: int = 10) -> bool:
    """Lets steps through one at a time until `cond(slots)` holds (at most `rounds`)."""
    for _ in range(rounds):
        gate.next()
        if cond(_slots(llm)):
            return True
    return False


# ---- the queue alone ------------------------------------------------------------------------
def _seq(rid: str, tenant: str | None, share: int | None = None, beams: int = 1):
    request = SimpleNamespace(request_id=rid, tenant=tenant, tenant_slots=share,
                              params=SimpleNamespace(num_beams=beams))
    return SimpleNamespace(request=request)


def _drain(q: WaitingQueue, held=None, free: int = 100) -> list[str]:
    held = held or {}
    out = []
    while (seq := q.take(free, lambda t: held.get(t, 0))) is not None:
        held[seq.request.tenant] = held.get(seq.request.tenant, 0) + 1
        out.append(seq.request.request_id)
    return out


def test_queue_round_robin_fifo_within_each_tenant():
    q = WaitingQueue()
    for rid, tenant in [("a0", "a"), ("a1", "a"), ("a2", "a"), ("b0", "b"), ("c0", "c"),
                        ("b1", "b"), ("n0", None)]:
        q.append(_seq(rid, tenant))
    assert len(q) == 7 and q.by_tenant() == {"a": 3, "b": 2, "c": 1, None: 1}
    assert _drain(q) == ["a0", "b0", "c0", "n0", "a1", "b1", "a2"]
    assert len(q) == 0 and not q


def test_queue_single_tenant_is_a_fifo_and_a_preempted_request_goes_first():
    q = WaitingQueue()
    for i in range(4):
        q.append(_seq(f"r{i}", None))
    q.appendleft(_seq("back", None))
    assert [s.request.request_id for s in q] == ["back", "r0", "r1", "r2", "r3"]
    assert _drain(q) == ["back", "r0", "r1", "r2", "r3"]
    q.append(_seq("a0", "a"))
    q.append(_seq("b0", "b"))
    q.appendleft(_seq("b-back", "b"))  # its tenant takes the next turn
    assert _drain(q) == ["b-back", "a0", "b0"]


def test_queue_shares_beams_and_removal():
    q = WaitingQueue()
    for i in range(3):
        q.append(_seq(f"a{i}", "a", share=1))
    q.append(_seq("b0", "b"))
    # a holds a row already: at its share of 1, b goes first and a waits
    assert _drain(q, held={"a": 1}) == ["b0"]
    assert len(q) == 3
    # a holding nothing may start one request, then waits again
    assert _drain(q) == ["a0"]
    # a beam search wider than the free rows keeps its turn: nothing overtakes it
    q2 = WaitingQueue()
    q2.append(_seq("beam", "a", beams=4))
    q2.append(_seq("b1", "b"))
    assert q2.take(3, lambda t: 0) is None
    assert q2.take(4, lambda t: 0).request.request_id == "beam"
    gone = q.remove_where(lambda s: s.request.request_id == "a2")
    assert [s.request.request_id for s in gone] == ["a2"] and len(q) == 1
    assert [s.request.request_id for s in q.clear()] == ["a1"] and len(q) == 0
