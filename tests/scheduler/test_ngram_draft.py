"""Prompt-lookup drafting (scheduler/ngram_draft.py): which earlier occurrence, how many tokens."""

from __future__ import annotations

import numpy as np

from metrale_jax.scheduler.ngram_draft import propose


def test_the_longest_suffix_wins_at_its_most_recent_occurrence():
    # suffix [1, 2, 3]: at 0 (followed by 9 9) and at 5 (followed by 7 8); [2, 3] alone also
    # at 10 (followed by 6): the 3-gram's latest occurrence wins.
    ids = [1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 2, 3, 6, 1, 2, 3]
    assert propose(ids, 2) == [7, 8]
    assert propose(ids, 5) == [7, 8, 2, 3, 6]
    assert propose(ids, 1, max_ngram=2) == [6]  # the 2-gram [2, 3]: latest at 10


def test_shorter_ngrams_and_no_match():
    assert propose([4, 5, 6, 4], 3) == [5, 6, 4]  # only the 1-gram [4] matches
    assert propose([4, 5, 6, 7], 3) == []
    assert propose([4, 5, 6, 4], 3, min_ngram=2) == []
    assert propose([4], 3) == [] and propose([], 3) == []
    assert propose([4, 4], 0) == []


def test_the_draft_stops_at_the_end_of_the_sequence():
    # [7, 7] matches at 0 (the only start before the suffix), followed by one 7 only.
    assert propose([7, 7, 7], 4) == [7]
    assert propose(np.array([5, 6, 5, 6]), 4) == [5, 6]


def test_the_gate_pauses_after_rejections_and_recovers():
    from metrale_jax.scheduler.ngram_draft import MAX_PAUSE, DraftGate
    gate = DraftGate()
    assert gate.ready(0)
    gate.update(10, 4, 1)  # less than half accepted: pause 1 token
    assert not gate.ready(10) and gate.ready(11)
    for _ in range(10):
        gate.update(20, 4, 0)
    assert gate.pause == MAX_PAUSE and not gate.ready(20 + MAX_PAUSE - 1)
    gate.update(40, 4, 2)  # half accepted: half the pause
    assert gate.pause == MAX_PAUSE // 2 and gate.ready(40 + MAX_PAUSE // 2)
    gate.update(50, 0, 0)  # no drafts: no change
    assert gate.pause == MAX_PAUSE // 2
