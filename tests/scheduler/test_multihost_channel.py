"""The multi-host side channel without jax.distributed: messages, replay and lost peers.

The channels run over loopback socket pairs; the engines are fakes that record their calls,
so the leader's and the follower's call sequences can be compared exactly.
"""

from __future__ import annotations

import socket
import threading

import numpy as np
import pytest

from metrale_jax import multihost as mh
from metrale_jax.engine import SlotSettings
from metrale_jax.errors import InvalidParameterError, PeerLostError


class FakeEngine:
    """Records init/add/step calls; states and outputs are NumPy arrays."""

    def __init__(self, refuse_slot: int | None = None):
        self.calls: list[tuple] = []
        self.refuse_slot = refuse_slot
        self.config = "config"

    def init_decode_state(self):
        self.calls.append(("init",))
        return np.zeros(2)

    def add(self, state, items):
        if any(slot == self.refuse_slot for slot, _, _ in items):
            raise InvalidParameterError("refused")
        self.calls.append(("add", items))
        return state + 1, np.ones(2)

    def step(self, state, active, allowed=None):
        self.calls.append(("step", active.tolist(), None if allowed is None else
                           allowed.tolist()))
        return state + 1, np.ones(2)

    def fork(self, moves):
        self.calls.append(("fork", [list(m) for m in moves]))
        return [(3, 4)]

    def beam_set(self, state, rows, copies):
        self.calls.append(("beam_set", [list(r) for r in rows], [list(c) for c in copies]))
        return state + 1


def _pair(on_lost=None) -> tuple[mh.LeaderChannel, mh.FollowerChannel]:
    a, b = socket.socketpair()
    return mh.LeaderChannel({1: a}, 2), mh.FollowerChannel(b, 1, on_lost)


def test_encode_decode_round_trip():
    settings = SlotSettings(temperature=0.7, top_p=0.9, seed=2**40 + 3, stop_ids=(2, 5),
                            logit_bias=((7, 1.5), (9, -100.0)), bad_words=((1, 2), (3, 4, 5)),
                            first_mask=np.array([1, 2**32 - 1], np.uint32))
    value = [(3, [1, 2, 3], settings), np.arange(6, dtype=np.int32).reshape(2, 3),
             {"flag": True, "x": None, "f": 0.1 + 0.2}]
    back = mh.decode(mh.encode(value))
    slot, ids, got = back[0]
    assert (slot, ids) == (3, [1, 2, 3]) and isinstance(back[0], tuple)
    assert got == settings and got.logit_bias == ((7, 1.5), (9, -100.0))
    assert got.first_mask.dtype == np.uint32 and got.first_mask.tolist() == [1, 2**32 - 1]
    assert back[1].dtype == np.int32 and back[1].tolist() == [[0, 1, 2], [3, 4, 5]]
    assert back[2] == {"flag": True, "x": None, "f": 0.1 + 0.2}
    with pytest.raises(TypeError):
        mh.encode(object())


def test_the_follower_replays_the_leaders_calls():
    leader_ch, follower_ch = _pair()
    leader, follower = FakeEngine(), FakeEngine()
    wrapped = mh.LeaderEngine(leader, leader_ch)
    done = threading.Event()
    errors: list[BaseException] = []

    def follow():
        try:
            mh.run_follower(follower, follower_ch)
        except BaseException as e:  # reported below
            errors.append(e)
        follower_ch.close()  # as the process's exit does
        done.set()

    threading.Thread(target=follow, daemon=True).start()
    state = wrapped.init_decode_state()
    state, _ = wrapped.add(state, [(0, [5, 6], SlotSettings(seed=11)),
                                   (1, [7], SlotSettings(repetition_penalty=1.2))])
    state, _ = wrapped.step(state, np.array([True, False]))
    state, _ = wrapped.step(state, np.array([True, True]), np.array([[3]], np.uint32))
    # beam search: a fork (a page call) and the program that sets the beam rows
    copies = wrapped.fork([(1, 0, 21)])
    state = wrapped.beam_set(state, [(0, 9, 21), (1, 8, 21)], copies)
    assert wrapped.config == "config"  # everything else is the engine's own
    leader_ch.close(timeout=30)
    assert done.wait(30) and not errors
    assert follower.calls == leader.calls and len(leader.calls) == 6


def test_a_call_the_engine_refuses_is_skipped_on_the_follower():
    leader_ch, follower_ch = _pair()
    follower = FakeEngine(refuse_slot=1)
    leader_ch.send({"op": "init", "args": [], "kwargs": mh.encode({})})
    leader_ch.send({"op": "add", "args": mh.encode([[(1, [2], SlotSettings())]]),
                    "kwargs": mh.encode({})})
    leader_ch.send({"op": "step", "args": mh.encode([np.array([False, True])]),
                    "kwargs": mh.encode({})})
    leader_ch.send({"op": "stop"})
    mh.run_follower(follower, follower_ch)
    assert [c[0] for c in follower.calls] == ["init", "step"]


def test_the_leader_sees_a_follower_go():
    leader_ch, follower_ch = _pair()
    seen: list[PeerLostError] = []
    lost = threading.Event()
    leader_ch.watch(lambda e: (seen.append(e), lost.set()))
    follower_ch.close()  # as the kernel does when the process dies
    assert lost.wait(30)
    assert "process 1 of 2" in seen[0].message and seen[0].code == "peer_lost"
    assert leader_ch.lost() is seen[0]
    with pytest.raises(PeerLostError):
        leader_ch.send({"op": "init"})
    wrapped = mh.LeaderEngine(FakeEngine(), leader_ch)
    with pytest.raises(PeerLostError):
        wrapped.step(np.zeros(2), np.array([True, True]))


def test_a_follower_sees_the_leader_go():
    seen: list[PeerLostError] = []
    lost = threading.Event()
    a, b = socket.socketpair()
    follower_ch = mh.FollowerChannel(b, 1, lambda e: (seen.append(e), lost.set()))
    a.close()
    assert lost.wait(30) and "process 0 of this multi-host server is gone" in seen[0].message
    with pytest.raises(PeerLostError):
        mh.run_follower(FakeEngine(), follower_ch)


def test_a_failed_call_after_a_loss_reports_the_loss():
    leader_ch, follower_ch = _pair()

    class Broken(FakeEngine):
        def step(self, state, active, allowed=None):
            follower_ch.close()  # the peer dies while the collective runs ...
            raise RuntimeError("gloo: connection reset")  # ... which fails obscurely

    leader_ch.watch(lambda e: None)
    with pytest.raises(PeerLostError) as err:
        mh.LeaderEngine(Broken(), leader_ch).step(np.zeros(2), np.array([True]))
    assert isinstance(err.value.__cause__, RuntimeError)


def test_a_leader_stopping_is_not_a_loss():
    leader_ch, follower_ch = _pair()
    calls: list = []
    leader_ch.watch(calls.append)
    done = threading.Event()

    def follow():
        mh.run_follower(FakeEngine(), follower_ch)
        follower_ch.close()
        done.set()

    threading.Thread(target=follow, daemon=True).start()
    leader_ch.close(timeout=30)
    assert done.wait(30)
    assert calls == [] and leader_ch.lost() is None
