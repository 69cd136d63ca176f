"""Which running sequences give way, and how: the KV pool's preemption and priority's.

Preemption frees a sequence's rows and pages; the scheduler puts its request back at the
head of the waiting queue (first among its priority), and it is recomputed later: its prompt
and the tokens generated so far are prefilled again and it continues where it stopped, so
its client sees only latency. The victim is always the worst priority (highest value), then
the most recently admitted sequence (then the highest slot: one round admits several).

- The KV pool's (`Scheduler._preempt`): a decoding row needs a page the pool cannot give.
- Priority's (`plan`): the request the waiting queue would admit next finds no free row, or
  the best-priority prompt being prefilled cannot get the page of its next piece (up to the
  smallest chunk bucket, beside the pages the decoding rows need for their next token):
  sequences of a strictly worse priority value give way, never one of an equal value. A
  sequence so preempted remembers the one it made room for (`made_room_for`) and is not
  admitted again (`yields`) until that one's prompt is in: two requests never take a row
  from each other in turn.

A beam search is one victim: all its rows are freed and it starts again from its prompt.
Only the loop thread calls these.
"""

from __future__ import annotations

from typing import Any

from metrale_jax.scheduler.rows import Rows
from metrale_jax.scheduler.sequence import Sequence
from metrale_jax.scheduler.waiting import priority_of


class Preemption:
    """Chooses victims among one engine's rows and frees them.

    Args:
        engine: the `Engine` (`pages`: the KV pool; `lengths`: each row's length;
            `config.chunk_buckets`).
        rows: the batch's `Rows`.

    Attributes:
        made_room_for: request id of a sequence preempted by priority -> the sequence it made
            room for (dropped once that one's prompt is in, or by `forget`).
    """

    def __init__(self, engine: Any, rows: Rows):
        self.engine = engine
        self.rows = rows
        self.made_room_for: dict[str, Sequence] = {}

    def by_worst(self) -> list[tuple[int, float, int, Sequence]]:
        """(priority, admitted at, slot, sequence) of each sequence holding rows (a beam
        search once), worst first."""
        latest: dict[int, tuple[int, float, int, Sequence]] = {}
        for slot, (rid, at) in list(self.rows.admitted_at.items()):
            seq = self.rows[slot]
            if seq is None or seq.request.request_id != rid:
                continue
            key = id(seq.beam.primary if seq.beam is not None else seq)
            if key not in latest or at > latest[key][1]:
                latest[key] = (priority_of(seq), at, slot, seq)
        return sorted(latest.values(), key=lambda r: (-r[0], -r[1], -r[2]))

    def yields(self, seq: Sequence) -> bool:
        """Whether `seq` (waiting) still waits for the sequence it made room for, which is
        prefilling its prompt; forgets the link once it is not."""
        rid = seq.request.request_id
        for_seq = self.made_room_for.get(rid)
        if for_seq is None:
            return False
        if any(self.rows[slot] is for_seq for slot in self.rows.prefilling):
            return True
        del self.made_room_for[rid]
        return False

    def forget(self, request_id: str) -> None:
        """A waiting request ended (cancelled, timed out): drops its link."""
        self.made_room_for.pop(request_id, None)

    def plan(self, head: Sequence | None) -> tuple[Sequence | None, list[tuple[int, Sequence]]]:
        """(the beneficiary, the (slot, sequence) victims) of preemption by priority, or
        (None, []) when none is due. `head`: the request the waiting queue would admit next
        (`WaitingQueue.peek`; None: none may go)."""
        if head is not None:
            want = head.request.params.num_beams - len(self.rows.free_slots())
            if want > 0:
                victims = self.victims(priority_of(head), want, pages=False)
                if victims:
                    return head, victims
        stalled = self.stalled_prompt()
        if stalled is not None:
            victims = self.victims(priority_of(stalled), 1, pages=True)
            if victims:
                return stalled, victims
        return None, []

    def victims(self, priority: int, rows: int, pages: bool) -> list[tuple[int, Sequence]]:
        """The running sequences, worst first, of a priority value above `priority` that
        free `rows` rows together ([] when they cannot); with `pages`, only those holding
        pages."""
        out, freed = [], 0
        owned = self.engine.pages.owned
        for prio, _, slot, seq in self.by_worst():
            if prio <= priority:
                break
            held = seq.beam.rows if seq.beam is not None else [slot]
            if pages and not any(int(owned[r]) for r in held):
                continue
            out.append((slot, seq))
            freed += len(held)
            if freed >= rows:
                return out
        return []

    def stalled_prompt(self) -> Sequence | None:
        """The best-priority prompt being prefilled (the first admitted among equals) whose
        next piece the KV pool cannot hold beside the pages the decoding rows need for their
        next token; None when none is stalled."""
        if not self.rows.prefilling:
            return None
        pages, lengths = self.engine.pages, self.engine.lengths
        decode_need = sum(pages.shortfall(b, int(lengths[b]) + 1)
                          for b, s in enumerate(self.rows.decoding()) if s is not None)
        left = pages.free_pages - decode_need
        smallest = self.engine.config.chunk_buckets[0]
        best = None
        for slot in self.rows.prefilling:
            seq = self.rows[slot]
            size = min(len(seq.feed) - seq.fed, smallest)
            if (pages.shortfall(slot, seq.fed + size) > left
                    and (best is None or priority_of(seq) < priority_of(best))):
                best = seq
        return best

    def free_rows(self, slot: int, seq: Sequence) -> Sequence:
        """Frees the rows of the sequence in row `slot` (every row of a beam search, which
        starts again from its prompt); returns the sequence that goes back to the queue (a
        beam search's primary, whichever row holds it now)."""
        if seq.beam is None:
            self.rows.free(slot)
            return seq
        group = seq.beam
        for row in group.rows:
            self.rows.free(row)
        seq = group.primary
        seq.beam, seq.beam_index = None, 0
        return seq
