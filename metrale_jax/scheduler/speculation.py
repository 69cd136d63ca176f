"""The batching loop's speculative decoding with prompt lookup (a part the `Scheduler` owns).

Rows whose requests speculate draft tokens from their own text (`ngram_draft.propose`, gated
by `DraftGate`); a step with drafts is a verify step (`Engine.verify`: each row's last token
and drafts in one forward, engine/speculative.py) instead of a decode step. Drafts need the
latest tokens, so while a row may draft the loop reads every step's output before launching
the next (`speculating`). While prompt pieces are being prefilled, rows decode plainly.
"""

from __future__ import annotations

import collections
from typing import Any

import numpy as np

from metrale_jax.scheduler.grammar_slots import GrammarSlots
from metrale_jax.scheduler.ngram_draft import DraftGate, propose
from metrale_jax.scheduler.rows import Pending, Rows
from metrale_jax.scheduler.sequence import Sequence


class Speculation:
    """Drafts and verify steps for one engine's rows.

    Args:
        engine: the `Engine` (`config.speculative_tokens`, `pages`, `lengths`, `verify`).
        rows: the batch's `Rows`.
        grammar: the slots' `GrammarSlots` (told which rows a verify step launched).
        stats: the scheduler's counters ("steps", "spec_drafted", "spec_accepted").
    """

    def __init__(self, engine: Any, rows: Rows, grammar: GrammarSlots,
                 stats: collections.Counter):
        self.engine = engine
        self.rows = rows
        self.grammar = grammar
        self.stats = stats
        self.max_len = engine.config.max_len

    def tokens(self, seq: Sequence | None) -> int:
        """The draft tokens a decoding sequence may propose per step (0: it does not
        speculate: off, constrained, thinking-budgeted or a beam search)."""
        if seq is None or seq.beam is not None or seq.matcher is not None \
                or seq.thinking is not None:
            return 0
        k = seq.request.params.speculative_tokens
        most = self.engine.config.speculative_tokens
        return min(most, most if k is None else k)

    def speculating(self) -> bool:
        """True when a decoding row may draft now (the loop then reads every step's output
        before the next: drafts are made from the latest tokens)."""
        return any(self.tokens(s) and gate(s).ready(s.num_generated)
                   for s in self.rows.decoding())

    def drafts(self, active: np.ndarray) -> list[list[int]] | None:
        """Each row's draft tokens (`active`: `[B]` bool, the rows that decode; prompt lookup
        over its prompt and output, no further than its token limit and its context), or
        None when no row has any or the pool cannot hold them."""
        if not self.engine.config.speculative_tokens:
            return None
        drafts: list[list[int]] = [[] for _ in range(len(self.rows))]
        pages, need = self.engine.pages, 0
        for b in np.flatnonzero(active):
            seq = self.rows[b]
            k = self.tokens(seq)
            if not k or seq.finished or not gate(seq).ready(seq.num_generated):
                continue
            k = min(k, seq.limit - seq.num_generated - 1,
                    self.max_len - 2 - int(self.engine.lengths[b]))
            if k < 1:
                continue
            drafts[b] = propose(seq.all_ids(), k)
            need += pages.shortfall(int(b), int(self.engine.lengths[b]) + 1 + len(drafts[b]))
        if not any(drafts) or need > pages.free_pages:
            return None
        return drafts

    def verify(self, state: Any, active: np.ndarray, allowed: np.ndarray | None,
               drafts: list[list[int]]) -> tuple[Any, Pending]:
        """Launches a verify step (`Engine.verify`): the active rows decode, the rows with
        drafts check them; its output is read like a decode step's, each row's first
        `emitted` tokens. Returns (the decode state, the launched step)."""
        state, out, emitted = self.engine.verify(state, active, allowed, drafts)
        self.stats["steps"] += 1
        drafted = sum(len(d) for d in drafts)
        self.stats["spec_drafted"] += drafted
        for b, d in enumerate(drafts):
            if d:
                seq = self.rows[b]
                self.stats["spec_accepted"] += int(emitted[b]) - 1
                gate(seq).update(seq.num_generated, len(d), int(emitted[b]) - 1)
        owners = self.rows.decode_owners(active)
        self.grammar.launched(np.array([slot for _, slot, _ in owners], np.int64))
        return state, Pending(out, owners, emitted)


def gate(seq: Sequence) -> DraftGate:
    """The sequence's `DraftGate` (made on first use)."""
    if seq.draft_gate is None:
        seq.draft_gate = DraftGate()
    return seq.draft_gate
