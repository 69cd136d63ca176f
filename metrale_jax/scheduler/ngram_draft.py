"""Prompt-lookup (n-gram) drafting: draft tokens for speculative decoding from the sequence itself.

vLLM's `ngram` speculator and llama.cpp's prompt lookup: the last `n` tokens of a sequence
(prompt + output) are looked for earlier in the same sequence, `n` from `max_ngram` down to
`min_ngram`; at the most recent earlier occurrence, the tokens that followed it are proposed
(up to `k`). Text that copies from its prompt (summaries, edits, code changes, quoting) is
drafted well. Free text matches short n-grams often but its drafts are seldom accepted, and a
verify step costs more than a decode step (k + 1 tokens, and the loop waits for each one's
output): `DraftGate` pauses a sequence's drafting after verifies that accept less than half
their drafts, the pause doubling up to `MAX_PAUSE` tokens, halving after one that accepts half
or more. (bench/speculative.py: free text at 5% acceptance, ungated, decoded 25% slower.)
Host only, NumPy; the engine verifies the drafts (`engine/speculative.py`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

MAX_NGRAM = 3
"""The longest suffix looked up."""
MIN_NGRAM = 1
"""The shortest suffix looked up."""
MAX_PAUSE = 32
"""The longest pause (in generated tokens) of a sequence whose drafts are not accepted."""


def propose(ids: Sequence[int] | np.ndarray, k: int, max_ngram: int = MAX_NGRAM,
            min_ngram: int = MIN_NGRAM) -> list[int]:
    """Up to `k` draft tokens continuing `ids` (the sequence so far, [L] ints).

    For n = max_ngram .. min_ngram, the suffix `ids[L-n:]` is searched at earlier starts
    i < L - n; at the largest such i (the most recent occurrence) the tokens
    `ids[i+n : i+n+k]` are returned (at least one: an occurrence is followed by a token). The
    first n that matches wins; no match (or k < 1) gives []."""
    if k < 1:
        return []
    arr = np.asarray(ids, dtype=np.int64)
    L = arr.shape[0]
    for n in range(min(max_ngram, L - 1), min_ngram - 1, -1):
        suffix = arr[L - n:]
        # Candidate starts i in [0, L - n - 1]: windows arr[i : i + n] of arr[:L - 1].
        windows = np.lib.stride_tricks.sliding_window_view(arr[:L - 1], n)
        hits = np.flatnonzero(np.all(windows == suffix, axis=1))
        if hits.size:
            i = int(hits[-1])
            return [int(t) for t in arr[i + n:i + n + k]]
    return []


class DraftGate:
    """Whether a sequence drafts now: paused for `pause` tokens after a verify that accepted
    less than half its drafts (the pause doubling, 1 .. MAX_PAUSE), the pause halved after a
    verify that accepted half or more."""

    def __init__(self) -> None:
        self.pause = 0
        self.resume_at = 0

    def ready(self, generated: int) -> bool:
        """True when the sequence, `generated` tokens in, may draft."""
        return generated >= self.resume_at

    def update(self, generated: int, drafted: int, accepted: int) -> None:
        """Records a verify of `drafted` tokens of which `accepted` were, `generated` tokens
        in (before it)."""
        if drafted == 0:
            return
        if 2 * accepted >= drafted:
            self.pause //= 2
        else:
            self.pause = min(MAX_PAUSE, max(1, 2 * self.pause))
        self.resume_at = generated + self.pause


__all__ = ["MAX_NGRAM", "MAX_PAUSE", "MIN_NGRAM", "DraftGate", "propose"]
