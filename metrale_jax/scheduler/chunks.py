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
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

from metrale_jax.engine import Piece
from metrale_jax.engine.images import remaining_images
from metrale_jax.scheduler.rows import Rows
from metrale_jax.scheduler.sequence import Sequence


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


class ChunkPlanner:
    """Plans each step's prompt pieces for one engine's rows.

    Args:
        engine: the `Engine` (config: chunk buckets, `max_prefill_len`, `max_prefill_batch`;
            `pages`, `step_cost`, `images`, `reserve`, `reuse_prefix`, `cache_pages`).
        rows: the batch's `Rows` (the sequences, and the prefilling slots in order).
        stats: the scheduler's counters (prefix cache queries and hits are added).
    """

    def __init__(self, engine: Any, rows: Rows, stats: collections.Counter):
        self.engine = engine
        self.rows = rows
        self.stats = stats

    def plan(self, decode_need: int) -> list[tuple[Piece, Sequence]]:
        """The prompt pieces of the next step, in admission order, each with its sequence:
        filling the largest chunk bucket that the waiting prompt tokens cover (the last
        piece cut to fit), the pieces after a context cut so that their cost together stays
        within `engine.step_cost.budget` (fresh prompts fill what they leave: the chunk's
        bucket is computed anyway), at most `max_prefill_batch` finishing, and leaving
        `decode_need` pages for the decoding rows. A row's first piece starts after the
        prefix it shares from the prefix cache (pages cached by earlier steps, or written by
        an earlier piece of this same step: the choices of one prompt prefill it once).
        Pages are reserved, and full ones offered to the cache, as pieces are chosen."""
        for slot in self.rows.prefilling:
            self.share_prefix(slot, self.rows[slot], decode_need)
        images = self.engine.images
        limit = self.engine.chunk_limit
        budget = _Budget(self._target(limit), self.engine.step_cost.budget,
                         images.free_slots if images is not None else 0, limit)
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

    def _target(self, limit: int) -> int:
        """The chunk bucket this step fills: the largest (up to `limit` tokens) that the
        waiting prompt tokens cover (a step computes no padding but when the prompts left
        are shorter than the smallest bucket)."""
        cfg, cost = self.engine.config, self.engine.step_cost
        left = []
        for slot in self.rows.prefilling:
            seq = self.rows[slot]
            rest = len(seq.feed) - seq.fed
            left.append(cost.piece_limit(rest, seq.fed, cost.budget) or cfg.chunk_buckets[0])
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
        if start:  # attention to its context: the dearer the longer that is
            size = min(size, cost.piece_limit(rest, start, budget.flops))
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
        budget.finishing += last
        seq.fed = end
        self.offer_pages(slot, seq, end)
        return piece

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
