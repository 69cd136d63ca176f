"""The batching loop's speculative decoding with prompt lookup (a part of `Scheduler`).

Rows whose requests speculate draft tokens from their own text (`ngram_draft.propose`, gated
by `DraftGate`); a step with drafts is a verify step (`Engine.verify`: each row's last token
and drafts in one forward, engine/speculative.py) instead of a decode step. Drafts need the
latest tokens, so while a row may draft the loop reads every step's output before launching
the next (`_speculating`). While prompt pieces are being prefilled, rows decode plainly.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from metrale_jax.scheduler.ngram_draft import DraftGate, propose
from metrale_jax.scheduler.sequence import Sequence


@dataclasses.dataclass
class Pending:
    """A launched step whose output is read one iteration later.

    owners: (column, slot, sequence) for every output column that carries a token: a decode
    row's column is its slot, a finished prompt's column is B + r; a slot whose owner changed
    (finished, freed, preempted, re-admitted) since then has its output ignored. emitted: a
    verify step's `[B]` count of tokens each row emits (None for other steps).
    """

    output: Any
    owners: list[tuple[int, int, Sequence]]
    emitted: np.ndarray | None = None


class SpeculativeDecoding:
    """`Scheduler`'s speculative decoding methods (they use its engine, slots, stats, grammar
    slots and decode state)."""

    def _spec_tokens(self, seq: Sequence | None) -> int:
        """The draft tokens a decoding sequence may propose per step (0: it does not
        speculate: off, constrained, thinking-budgeted or a beam search)."""
        if seq is None or seq.beam is not None or seq.matcher is not None \
                or seq.thinking is not None:
            return 0
        k = seq.request.params.speculative_tokens
        most = self.engine.config.speculative_tokens
        return min(most, most if k is None else k)

    def _speculating(self) -> bool:
        """True when a decoding row may draft now (the loop then reads every step's output
        before the next: drafts are made from the latest tokens)."""
        return any(self._spec_tokens(s) and self._gate(s).ready(s.num_generated)
                   for s in self._decoding())

    @staticmethod
    def _gate(seq: Sequence) -> DraftGate:
        """The sequence's `DraftGate` (made on first use)."""
        if seq.draft_gate is None:
            seq.draft_gate = DraftGate()
        return seq.draft_gate

    def _drafts(self, active: np.ndarray) -> list[list[int]] | None:
        """Each row's draft tokens (prompt lookup over its prompt and output, no further
        than its token limit and its context), or None when no row has any or the pool
        cannot hold them."""
        if not self.engine.config.speculative_tokens:
            return None
        drafts: list[list[int]] = [[] for _ in range(self.num_slots)]
        pages, need = self.engine.pages, 0
        for b in np.flatnonzero(active):
            seq = self._slots[b]
            k = self._spec_tokens(seq)
            if not k or seq.finished or not self._gate(seq).ready(seq.num_generated):
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

    def _launch_verify(self, active: np.ndarray, allowed: np.ndarray | None,
                       drafts: list[list[int]]) -> Pending:
        """Launches a verify step (`Engine.verify`): the active rows decode, the rows with
        drafts check them; its output is read like a decode step's, each row's first
        `emitted` tokens."""
        self.state, out, emitted = self.engine.verify(self.state, active, allowed, drafts)
        self.stats["steps"] += 1
        drafted = sum(len(d) for d in drafts)
        self.stats["spec_drafted"] += drafted
        for b, d in enumerate(drafts):
            if d:
                seq = self._slots[b]
                self.stats["spec_accepted"] += int(emitted[b]) - 1
                self._gate(seq).update(seq.num_generated, len(d), int(emitted[b]) - 1)
        owners = [(int(i), int(i), self._slots[i]) for i in np.flatnonzero(active)]
        for _, _, seq in owners:
            if seq.beam is not None:  # it waits for this step's top tokens
                seq.beam.ready = False
        self.grammar.launched(np.array([slot for _, slot, _ in owners], np.int64))
        return Pending(out, owners, emitted)
