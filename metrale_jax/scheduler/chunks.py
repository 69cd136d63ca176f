"""Chunk planning: which pieces of the admitted prompts ride along the next step.

A step runs every decoding row's token plus a chunk of C prompt tokens, made of pieces of
several prompts (`Piece`s, in admission order). The plan fills the largest chunk bucket that
the waiting prompt tokens cover, within `engine.chunk_limit` (smaller while the grid still
compiles in the background; the last piece cut to fit; the rest rides along the next
step), keeps the cost of pieces that attend to a context (a prompt's later piece, or one after
a shared prefix) within the step's budget (`engine.step_cost`), lets at most
`max_prefill_batch` prompts finish, and leaves the pages the decoding rows need. The prefix
cache is part of it: a row's first piece starts after the cached pages that continue its
prefix (`share_prefix`), and the full pages a row writes are offered to the cache
(`offer_pages`).

The latency target (`step_time.StepTimes`): while rows decode, the chunk's bucket and its
pieces are sized so that the step's predicted time stays within the tightest target of the
decoding rows (the first piece may still take the smallest bucket: prompts progress), and the
FLOP budget of pieces after a context applies; with no row decoding the full chunk runs, with
no FLOP cap (nothing waits for the step but the prompts themselves).
"""

from __future__ import annotations

import collections
import dataclasses
import math
from typing import Any

import numpy as np

from metrale_jax.engine import Piece
from metrale_jax.engine.images import remaining_images
from metrale_jax.scheduler.rows import Rows
from metrale_jax.scheduler.sequence import Sequence
from metrale_jax.scheduler.step_time import StepTimes


@dataclasses.dataclass
class _Budget:
    """What is left of one step's budgets while its pieces are chosen."""

    target: int  # the chunk bucket the pieces fill (tokens)
    flops: float  # the cost left for pieces after a context (`step_cost.budget`)
    image_slots: int  # free slots of the image pool
    limit: int  # the most prompt tokens the step may carry (`engine.chunk_limit`)
    used: int = 0  # prompt tokens chosen
    finishing: int = 0  # pieces chosen that end their prompt
    full: bool = False  # no further piece fits this step
    gate: tuple[int, float] | None = None  # (decode rows n, target seconds) while rows decode
    context: float = 0.0  # FLOPs of the chosen pieces' attention to their contexts
    late: bool = False  # a chosen piece attends to a context


class ChunkPlanner:
    """Plans each step's prompt pieces for one engine's rows.

    Args:
        engine: the `Engine` (config: chunk buckets, `max_prefill_len`, `max_prefill_batch`;
            `pages`, `step_cost`, `images`, `reserve`, `reuse_prefix`, `cache_pages`).
        rows: the batch's `Rows` (the sequences, and the prefilling slots in order).
        stats: the scheduler's counters (prefix cache queries and hits are added).
        times: the step-time model and latency gate (None: no gate).
    """

    def __init__(self, engine: Any, rows: Rows, stats: collections.Counter,
                 times: StepTimes | None = None):
        self.engine = engine
        self.rows = rows
        self.stats = stats
        self.times = times

    def plan(self, decode_need: int,
             active: np.ndarray | None = None) -> list[tuple[Piece, Sequence]]:
        """The prompt pieces of the next step, in admission order, each with its sequence:
        filling the largest chunk bucket that the waiting prompt tokens cover (the last
        piece cut to fit), the pieces after a context cut so that their cost together stays
        within `engine.step_cost.budget` (fresh prompts fill what they leave: the chunk's
        bucket is computed anyway), at most `max_prefill_batch` finishing, and leaving
        `decode_need` pages for the decoding rows. A row's first piece starts after the
        prefix it shares from the prefix cache (pages cached by earlier steps, or written by
        an earlier piece of this same step: the choices of one prompt prefill it once).
        Pages are reserved, and full ones offered to the cache, as pieces are chosen.
        active: `[B]` bool, the rows that decode in the step (None or none: nothing is
        gated and pieces after a context are not capped)."""
        for slot in self.rows.prefilling:
            self.share_prefix(slot, self.rows[slot], decode_need)
        images = self.engine.images
        limit = self.engine.chunk_limit
        decoding = np.flatnonzero(active) if active is not None else np.zeros(0, np.int64)
        gate = self._gate(decoding)
        if gate is not None:
            limit = self.times.chunk_limit(gate[0], gate[1], limit)
        capped = decoding.size > 0
        budget = _Budget(self._target(limit, capped),
                         self.engine.step_cost.budget if capped else math.inf,
                         images.free_slots if images is not None else 0, limit, gate=gate)
        out: list[tuple[Piece, Sequence]] = []
        for slot in self.rows.prefilling:
            seq = self.rows[slot]
            self.share_prefix(slot, seq, decode_need)  # what earlier pieces just offered
            piece = self._piece(slot, seq, budget, decode_need, first=not out)
            if budget.full:
                break
            if piece is not None:
                out.append((piece, seq))
        return out

    def _gate(self, decoding: np.ndarray) -> tuple[int, float] | None:
        """(n, target seconds) of a step beside the decoding rows `decoding` (slots): n its
        mixed row bucket, target the rows' tightest; None without rows or a target."""
        if self.times is None or not decoding.size:
            return None
        target = self.times.target_s(
            self.rows[int(b)].request.max_itl_ms for b in decoding
            if self.rows[int(b)] is not None)
        if target is None:
            return None
        return self.times.mixed_rows(int(decoding[-1]) + 1), target

    def _target(self, limit: int, capped: bool = True) -> int:
        """The chunk bucket this step fills: the largest (up to `limit` tokens) that the
        waiting prompt tokens cover (a step computes no padding but when the prompts left
        are shorter than the smallest bucket); `capped`: a later piece counts only what the
        FLOP budget lets it take."""
        cfg, cost = self.engine.config, self.engine.step_cost
        left = []
        for slot in self.rows.prefilling:
            seq = self.rows[slot]
            rest = len(seq.feed) - seq.fed
            take = cost.piece_limit(rest, seq.fed, cost.budget) if capped else rest
            left.append(take or cfg.chunk_buckets[0])
        filled = [c for c in cfg.chunk_buckets if c <= min(sum(left), limit)]
        return filled[-1] if filled else cfg.chunk_buckets[0]

    def _piece(self, slot: int, seq: Sequence, budget: _Budget, decode_need: int,
               first: bool) -> Piece | None:
        """Row `slot`'s next piece within `budget` (which it then uses); None when the row
        waits for image slots (later rows may still go) or, with `budget.full` set, when no
        further piece fits this step."""
        cfg, pages, cost = self.engine.config, self.engine.pages, self.engine.step_cost
        start = seq.fed
        rest = len(seq.feed) - start
        size = min(rest, budget.target - budget.used)
        if start and budget.flops < math.inf:  # attention to its context: the dearer the
            size = min(size, cost.piece_limit(rest, start, budget.flops))  # longer that is
        if budget.gate is not None and size > 0:
            size = self._fit(size, start, budget)
        if first:  # the step always makes progress
            size = max(size, min(rest, cfg.chunk_buckets[0]))
        end = start + size
        last = end == len(seq.feed)
        images = ()
        new_images = 0
        if seq.request.images:
            # Every image still ahead of the row is encoded with its first piece: a row
            # holds all its remaining images or none, so a row that holds some never
            # waits for slots (no two rows can each hold part of what the other needs).
            T = self.engine.model_config.vision.tokens_per_image
            images = remaining_images(seq.request.images, start, T)
            new_images = len(self.engine.images.missing(slot, images))
        if (size <= 0 or budget.used + size > budget.limit
                or (last and budget.finishing >= cfg.max_prefill_batch)
                or pages.shortfall(slot, end) > pages.free_pages - decode_need):
            budget.full = True
            return None
        if new_images > budget.image_slots:  # it waits for slots; rows after it take no
            budget.image_slots = 0            # new ones meanwhile (its turn comes first)
            return None
        budget.image_slots -= new_images
        settings = None
        if last:
            settings = seq.settings
            if seq.token_ids:  # resumed: what was generated before counts as generated
                settings = dataclasses.replace(settings, generated=len(seq.token_ids))
        first_generated = seq.prompt_len if seq.token_ids else 0
        prefix = self._seed(seq, start)
        self.engine.reserve(slot, end)
        source = seq.request.source if start == 0 else ()
        piece = Piece(slot, tuple(seq.feed[start:end]), start, settings, first_generated,
                      prefix, seq.lora, source, images)
        budget.used += size
        if start:
            budget.flops -= cost.piece_flops(size, start)
            budget.context += cost.context_flops(size, start)
            budget.late = True
        budget.finishing += last
        seq.fed = end
        self.offer_pages(slot, seq, end)
        return piece

    def _fit(self, size: int, start: int, budget: _Budget) -> int:
        """The most tokens (`size`, else the largest chunk bucket below it) a piece at `start`
        may take so that the step stays within the gate's target (`StepTimes.fits`); 0 when
        none fits."""
        n, target = budget.gate
        cost = self.engine.step_cost
        for s in [size, *(c for c in reversed(self.engine.config.chunk_buckets) if c < size)]:
            if self.times.fits(n, budget.used + s, budget.context + cost.context_flops(s, start),
                               budget.late or start > 0, target):
                return s
        return 0

    def _seed(self, seq: Sequence, start: int) -> tuple[int, ...]:
        """The token history a row's first piece sets (the prefix it shared, `start`
        tokens; empty for later pieces); counts the prefix cache's queries and hits at a
        request's first admission."""
        if seq.seeded:
            return ()
        seq.seeded = True
        prefix = tuple(seq.feed[:start])
        if seq.cached_tokens is None:  # a new request (not one resumed)
            seq.cached_tokens = min(start, seq.prompt_len)
            seq.handle.cached_tokens = seq.cached_tokens  # for an end made by the caller
            if self.engine.pages.cache is not None:
                self.stats["prefix_cache_queries"] += seq.prompt_len
                self.stats["prefix_cache_hits"] += seq.cached_tokens
        return prefix

    def share_prefix(self, slot: int, seq: Sequence, decode_need: int) -> None:
        """Row `slot`, before its first piece, shares the cached pages that continue its
        prefix (whole pages, leaving at least the prompt's last token to compute: its logits
        give the first token); `decode_need` pages stay for the decoding rows."""
        pages = self.engine.pages
        if pages.cache is None or seq.seeded:
            return
        ps = pages.page_size
        have = int(pages.owned[slot])
        limit = (len(seq.feed) - 1) // ps
        if seq.fed != have * ps or have >= limit:
            return
        keys = seq.keys_for(limit, ps)[have:]
        got = self.engine.reuse_prefix(slot, keys, pages.free_pages - decode_need)
        seq.fed += got * ps
        seq.keyed = have + got

    def offer_pages(self, slot: int, seq: Sequence, written: int) -> None:
        """Offers the prefix cache row `slot`'s full pages whose `written` first positions
        are (or are being) written and whose tokens are known."""
        pages = self.engine.pages
        if pages.cache is None:
            return
        ps = pages.page_size
        full = min(written, seq.prompt_len + len(seq.token_ids), int(pages.owned[slot]) * ps)
        full //= ps
        if full > seq.keyed:
            keys = seq.keys_for(full, ps)
            self.engine.cache_pages(slot, seq.keyed, keys[seq.keyed:full])
            seq.keyed = full
