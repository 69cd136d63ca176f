"""The batch's rows as the loop sees them: which sequence each slot holds, the prompts being
prefilled, when each was admitted, and a launched step whose output is read one step late.

`Rows` is shared by the scheduler's parts (chunk planning, beam rows, speculation); only the
loop thread writes it. `snapshot` readers on other threads read it through `occupancy`,
which copies the slot list at once.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable
from typing import Any

import numpy as np

from metrale_jax.scheduler.events import Event
from metrale_jax.scheduler.grammar_slots import GrammarSlots
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


class Rows:
    """The B slots of one engine and the sequences that hold them.

    Args:
        engine: the `Engine` whose rows these are (`release` frees a row's pages).
        grammar: the slots' `GrammarSlots` (told when a row is freed).
        num_slots: B.

    Attributes:
        seqs: `[B]` the sequence in each slot (None: free).
        prefilling: the slots whose prompt is being prefilled, in admission order.
        admitted_at: slot -> (request id, `time.monotonic()` at admission); a dict item
            assignment is atomic, so `occupancy` may read it from another thread.
    """

    def __init__(self, engine: Any, grammar: GrammarSlots, num_slots: int):
        self.engine = engine
        self.grammar = grammar
        self.seqs: list[Sequence | None] = [None] * num_slots
        self.prefilling: list[int] = []
        self.admitted_at: dict[int, tuple[str, float]] = {}

    def __len__(self) -> int:
        return len(self.seqs)

    def __getitem__(self, slot: int) -> Sequence | None:
        return self.seqs[slot]

    def __setitem__(self, slot: int, seq: Sequence | None) -> None:
        self.seqs[slot] = seq

    def busy(self) -> bool:
        """Whether any slot holds a sequence."""
        return any(self.seqs)

    def free_slots(self) -> list[int]:
        """The free slots, lowest first."""
        return [i for i, s in enumerate(self.seqs) if s is None]

    def place(self, slot: int, seq: Sequence, now: float) -> None:
        """Admits `seq` into row `slot` at `now` (`time.monotonic()`): its settings are
        fixed at its first admission (seed drawn, grammar started), and its prompt (plus
        what it generated before a preemption) is to be prefilled from the start."""
        if seq.settings is None:  # first admission (a preempted one keeps its own)
            seed = seq.request.params.seed
            if seed is None:
                seed = random.getrandbits(31)
            first_mask = None
            if seq.request.params.constraint is not None:
                seq.matcher, first_mask = self.grammar.start(seq.request.params.constraint)
            seq.settings = seq.slot_settings(seed, first_mask)
        elif seq.matcher is not None:  # resumed: the grammar's mask where it stopped
            seq.settings = dataclasses.replace(seq.settings,
                                               first_mask=self.grammar.mask_of(seq.matcher))
        seq.feed = list(seq.request.prompt_ids) + list(seq.token_ids)
        seq.fed = 0
        seq.keyed = 0
        seq.seeded = False
        self.seqs[slot] = seq
        self.prefilling.append(slot)
        self.admitted_at[slot] = (seq.request.request_id, now)
        if seq.handle.admitted_at is None:
            seq.handle.admitted_at = now
        self.grammar.freed(slot)

    def free(self, slot: int) -> None:
        """Slot `slot` loses its sequence: its pages go back to the pool."""
        seq = self.seqs[slot]
        self.seqs[slot] = None
        if seq is not None and slot in self.prefilling:
            self.prefilling.remove(slot)
        self.engine.release(slot)
        self.grammar.freed(slot)

    def end_each(self, event: Callable[[Sequence], Event]) -> None:
        """Posts `event(seq)` to every row's sequence, then frees the row."""
        for i, seq in enumerate(self.seqs):
            if seq is not None:
                seq.handle.post(event(seq))
                self.free(i)

    def end_where(self, ended: Callable[[Sequence], bool],
                  event: Callable[[Sequence], Event]) -> None:
        """Frees every row whose sequence is `ended`, then posts it `event(seq)` (a client
        that saw its request end sees its slot free)."""
        for i, seq in enumerate(self.seqs):
            if seq is not None and ended(seq):
                self.free(i)
                seq.handle.post(event(seq))

    def decoding(self) -> list[Sequence | None]:
        """The slots' sequences that decode (None for free rows, rows still prefilling,
        pooling requests and beam rows waiting for their search's next step)."""
        return [s if s is not None and s.fed >= len(s.feed) and not s.request.pooling
                and (s.beam is None or s.beam.ready) else None for s in self.seqs]

    def decode_owners(self, active: np.ndarray) -> list[tuple[int, int, Sequence]]:
        """The (column, slot, sequence) owners of a step's decode rows (`active`: `[B]`
        bool); beam rows among them now wait for this step's top tokens."""
        owners = [(int(i), int(i), self.seqs[i]) for i in np.flatnonzero(active)]
        for _, _, seq in owners:
            if seq.beam is not None:
                seq.beam.ready = False
        return owners

    def occupancy(self, now: float) -> list[dict[str, Any] | None]:
        """Each slot as `snapshot` reports it (any thread): None, or {"request_id", "tenant",
        "prompt_tokens", "tokens" (generated so far), "running_s" (since admission)}. A
        finished sequence's slot reads as free: its last event is posted before the loop
        frees the row, and a client that saw its request end must not see it running."""
        admitted = dict(self.admitted_at)
        slots: list[dict[str, Any] | None] = []
        for i, seq in enumerate(list(self.seqs)):
            if seq is None or seq.finished:
                slots.append(None)
                continue
            rid = seq.request.request_id
            since = admitted.get(i)
            slots.append({"request_id": rid, "tenant": seq.request.tenant,
                          "prompt_tokens": seq.prompt_len, "tokens": seq.num_generated,
                          "running_s": now - since[1] if since and since[0] == rid else None})
        return slots
