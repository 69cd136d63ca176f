"""Beam rows: a beam search's W running beams as W rows of the batch (the search itself is
`beam.BeamSearch`, on the host).

A beam request is admitted into W slots at once (`BeamGroup`). Its first row prefills the
prompt; the others wait, empty, for the first step's fork. Every step each running beam's
row returns its top tokens (`StepOutput.top_ids`, `top_logprobs`); once every beam has its
list, the search steps: each new beam keeps its parent's row or forks it (`Engine.fork`: the
new row shares the parent's full pages and copies its partly written last one), and every
moved row is set with its last token in one `beam_set` program per iteration (`flush`). The
request's events (one `Token` of the best hypothesis and `Finished` with every returned
hypothesis) go out once the search ends.
"""

from __future__ import annotations

import collections
from typing import Any

import numpy as np

from metrale_jax.scheduler.beam import BeamSearch
from metrale_jax.scheduler.events import BeamHypothesis, Finished, Token
from metrale_jax.scheduler.grammar_slots import GrammarSlots
from metrale_jax.scheduler.rows import Rows
from metrale_jax.scheduler.sequence import Sequence


class BeamGroup:
    """A beam request's rows (`rows[i]`: the slot of running beam i), its search, and the
    top lists its rows have returned in the current step."""

    def __init__(self, primary: Sequence, rows: list[int]):
        self.primary = primary
        self.rows = rows
        self.search: BeamSearch | None = None
        self.tops: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self.ready = False  # its rows are set for the next decode step


class _NoEvents:
    """The handle of a beam's helper rows: their request's events go out once, from the
    first row's sequence."""

    def post(self, event: Any) -> None:
        """Drops `event`."""


_NO_EVENTS = _NoEvents()


class BeamRows:
    """Runs the beam searches of one engine's rows.

    Args:
        engine: the `Engine` (`fork`, `beam_set`).
        tokenizer: the model's tokenizer (hypotheses are decoded to text).
        eos_token_ids: the model's eos ids (they end a hypothesis unless `ignore_eos`).
        max_len: the context length (S).
        rows: the batch's `Rows`.
        grammar: the slots' `GrammarSlots` (told when a helper row takes a slot).
        stats: the scheduler's counters ("finished", "tokens").
    """

    def __init__(self, engine: Any, tokenizer: Any, eos_token_ids: tuple[int, ...],
                 max_len: int, rows: Rows, grammar: GrammarSlots,
                 stats: collections.Counter):
        self.engine = engine
        self.tokenizer = tokenizer
        self.eos_token_ids = tuple(eos_token_ids)
        self.max_len = max_len
        self.rows = rows
        self.grammar = grammar
        self.stats = stats
        # Beam rows to set and pages to copy before the next step (`flush`).
        self._sets: list[tuple[int, int, int]] = []
        self._copies: list[tuple[int, int]] = []

    def start(self, seq: Sequence, slots: list[int]) -> None:
        """A beam request was admitted into `slots` (its first, `seq`'s, prefills the
        prompt; the others wait, empty, for the first step's fork)."""
        seq.beam = group = BeamGroup(seq, slots)
        p = seq.request.params
        eos = frozenset(() if p.ignore_eos else self.eos_token_ids) | set(p.stop_token_ids)
        # A translation's target language token is forced, and transformers counts it as
        # generated (lengths are counted after the decoder start token).
        counted = seq.prompt_len - 1 if seq.request.source else 0
        group.search = BeamSearch(p.num_beams, min(p.max_tokens or self.max_len,
                                                   self.max_len - seq.prompt_len),
                                  eos, p.min_tokens, p.length_penalty, p.early_stopping,
                                  length_offset=counted)
        for i, slot in enumerate(group.rows[1:], 1):
            helper = Sequence(seq.request, _NO_EVENTS, self.tokenizer, self.eos_token_ids,
                              self.max_len, lora=seq.lora)
            helper.beam, helper.beam_index = group, i
            helper.settings, helper.seeded = seq.settings, True
            self.rows[slot] = helper
            self.grammar.freed(slot)

    def output(self, seq: Sequence, top_ids: np.ndarray, top_lps: np.ndarray) -> None:
        """One beam row's next-token top list (`[N]` ids and log-probabilities); once every
        running beam has one, a search step: the beams fork (their rows share their
        parents' pages) and are fed again, or the search ends."""
        group = seq.beam
        group.tops[seq.beam_index] = (top_ids, top_lps)
        search = group.search
        first = search.generated == 0
        if len(group.tops) < (1 if first else search.width):
            return
        tops = [group.tops[0]] * search.width if first else \
            [group.tops[i] for i in range(search.width)]
        group.tops = {}
        parents = search.step(np.stack([t[0] for t in tops]), np.stack([t[1] for t in tops]))
        if search.done:
            self.finish(group)
            return
        prompt = list(group.primary.request.prompt_ids)
        rows, claimed = group.rows, set()
        new_rows: list[int | None] = [None] * search.width
        for c, (parent, _) in enumerate(parents):  # a parent's first child keeps its row
            if parent not in claimed:
                claimed.add(parent)
                new_rows[c] = rows[parent]
        spare = [rows[i] for i in range(search.width) if i not in claimed]
        # The parents' rows hold positions < `written`; each new beam feeds its last token
        # there. A beam on another row forks: it shares the parent's full pages and copies
        # its partly written last one.
        written = len(prompt) + search.generated - 1
        moves = []
        for c, (parent, _) in enumerate(parents):
            if new_rows[c] is None:
                new_rows[c] = spare.pop()
                moves.append((new_rows[c], rows[parent], written))
        copies = self.engine.fork(moves) if moves else []
        sets = []
        for c, slot in enumerate(new_rows):
            row = self.rows[slot]
            row.beam_index = c
            row.feed = prompt + list(search.running[c])
            row.fed = len(row.feed)
            sets.append((slot, search.running[c][-1], written))
        self._sets += sets  # one beam_set for every search at the end of the read (`flush`)
        self._copies += copies
        group.rows = new_rows
        group.ready = True  # its rows decode in the next step

    def finish(self, group: BeamGroup) -> None:
        """Posts a finished search's answer on the request (the best hypothesis as its
        tokens; the best num_return_sequences in `Finished.beams`) and frees its rows."""
        seq = group.primary
        p = seq.request.params
        hyps = tuple(BeamHypothesis(ids, self.tokenizer.decode(
            list(ids), skip_special_tokens=p.skip_special_tokens), score, reason)
            for ids, score, reason in group.search.results(p.num_return_sequences))
        best = hyps[0]
        for slot in group.rows:
            self.rows[slot].finished = True
            self.rows.free(slot)
        seq.num_generated = len(best.token_ids)
        if best.token_ids:
            seq.handle.post(Token(best.token_ids, best.text))
        stop = best.token_ids[-1] if best.finish_reason == "stop" and \
            best.token_ids[-1] not in self.eos_token_ids else None
        self.stats["finished"] += 1  # counted before the client can see the end
        self.stats["tokens"] += len(best.token_ids)
        seq.handle.post(Finished(best.finish_reason, seq.input_tokens, len(best.token_ids),
                                 stop, "", seq.cached_tokens or 0, hyps))

    def flush(self, state: Any) -> Any:
        """Sets every beam row that a search step moved (and makes the page copies of their
        forks) in one `beam_set` program, whatever the number of searches; returns the
        decode state."""
        if self._sets:
            sets, copies = self._sets, self._copies
            self._sets, self._copies = [], []
            state = self.engine.beam_set(state, sets, copies)
        return state

    def reset(self) -> None:
        """Drops the sets and copies not flushed (the loop failed and rebuilds its state)."""
        self._sets, self._copies = [], []
