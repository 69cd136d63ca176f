"""Prompt pieces: what a ragged step prefills, and how they become the step's chunk inputs.

A `Piece` is a run of one prompt's tokens for one row. A step takes up to max_prefill_len
tokens of pieces (of several prompts) and up to R = max_prefill_batch pieces that end their
prompt (their first token is sampled in the step). `PiecePacker.pack` checks the pieces,
allocates their pages and lays them out as `steps.ChunkInputs` in the smallest chunk bucket
`C` that holds them; `plan_pieces` takes the pieces of one step from a queue.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from metrale_jax.engine import steps
from metrale_jax.engine.bitmask import all_allowed
from metrale_jax.engine.config import EngineConfig
from metrale_jax.engine.images import ImagePool
from metrale_jax.engine.pages import PageTable
from metrale_jax.engine.placement import StepShardings
from metrale_jax.engine.programs import Job, ProgramCache, spec
from metrale_jax.engine.state import DecodeState, SlotSettings, settings_to_arrays
from metrale_jax.errors import ContextLengthError, InvalidParameterError
from metrale_jax.vision.prompt import PromptImage


class OutOfPagesError(RuntimeError):
    """The page pool cannot hold what a step would write (the host preempts or waits)."""


@dataclasses.dataclass(frozen=True)
class Piece:
    """A piece of one prompt for a ragged step: `tokens` (ids) at positions `start ..`, of
    row `slot`; `settings` is the request's `SlotSettings` on the prompt's last piece (its
    first token is sampled in the step) and None on earlier pieces. first_generated: for a
    preempted request fed again, the position of its first generated token (the tokens from
    there count as generated for the penalties); 0 = none. prefix: on a row's first piece
    when its positions before `start` are shared pages from the prefix cache, the token ids
    of those positions (they seed the row's token history); else empty. lora: the row's
    LoRA adapters as (slot, weight) pairs (empty: none), for this piece and the row's
    decoding after it. source: an encoder-decoder row's source (encoder input ids), on its
    first piece (start 0): the encoder runs over it before the step (`check_source`); else
    empty. images: a vision-language model's prompt images still ahead of the row from
    `start` on (those the row does not hold yet are encoded before the step)."""

    slot: int
    tokens: tuple[int, ...]
    start: int
    settings: SlotSettings | None
    first_generated: int = 0
    prefix: tuple[int, ...] = ()
    lora: tuple[tuple[int, float], ...] = ()
    source: tuple[int, ...] = ()
    images: tuple[PromptImage, ...] = ()

    @classmethod
    def cut(cls, slot: int, ids: Sequence[int], settings: SlotSettings,
            size: int) -> list[Piece]:
        """A prompt's pieces of `size` tokens (the last one shorter, with the settings)."""
        ids = tuple(int(t) for t in ids)
        starts = range(0, len(ids), size)
        return [cls(slot, ids[s:s + size], s, settings if s + size >= len(ids) else None)
                for s in starts]


def check_prompt(n: int, max_len: int) -> None:
    """Raises if a prompt of `n` tokens cannot be prefilled into a row of `max_len` positions
    (one is kept for the first generated token)."""
    limit = max_len - 1
    if n < 1:
        raise InvalidParameterError("the prompt is empty", param="messages")
    if n > limit:
        raise ContextLengthError(
            f"the prompt has {n} tokens, but this engine holds at most {limit} prompt "
            f"tokens (max_len {max_len} minus one for the first generated token)")


def plan_pieces(work: collections.deque, budget: int,
                finish_limit: int) -> tuple[list[Piece], list[int]]:
    """Takes from the front of `work` ((item, Piece) pairs, in order) the pieces of one step:
    at most `budget` tokens, `finish_limit` finishing pieces, one piece per row and a row's
    pieces in order. Returns the pieces and the items of the finishing
    ones (in order)."""
    batch: list[Piece] = []
    cols: list[int] = []
    used, rows = 0, set()
    while work:
        item, piece = work[0]
        if (used + len(piece.tokens) > budget or piece.slot in rows
                or (piece.settings is not None and len(cols) >= finish_limit)):
            break
        work.popleft()
        batch.append(piece)
        used += len(piece.tokens)
        rows.add(piece.slot)
        if piece.settings is not None:
            cols.append(item)
    return batch, cols


def take_pages(pages: PageTable, slot: int, length: int) -> None:
    """Gives row `slot` the pages for `length` positions; `OutOfPagesError` when the pool is
    short."""
    if not pages.ensure(slot, length):
        raise OutOfPagesError(f"row {slot} needs {pages.shortfall(slot, length)} more "
                              f"pages; {pages.free_pages} free")


class PiecePacker:
    """Checks a step's pieces and packs them into its chunk inputs; seeds the token history
    of a row that shares a cached prefix (the `seed` program, `steps.seed_history`).

    pages: the engine's `PageTable`; images: the image pool of a vision-language model, else
    None; state_spec: the abstract `DecodeState`."""

    def __init__(self, config: EngineConfig, vocab_size: int, pages: PageTable,
                 images: ImagePool | None, cache: ProgramCache, shardings: StepShardings,
                 state_spec: DecodeState):
        self.config, self.vocab_size, self.pages, self.images = config, vocab_size, pages, images
        self.cache, self.shardings, self.state_spec = cache, shardings, state_spec

    def seed_program(self) -> Any:
        """The program that seeds a row's token history with a shared prefix."""
        i32 = jnp.int32
        fn = jax.jit(steps.seed_history, donate_argnums=(0,), out_shardings=self.shardings.state)
        return self.cache.compile(("seed",), fn, self.state_spec, spec((), i32),
                                  spec((self.config.max_len,), i32), spec((), i32),
                                  spec((), i32))

    def jobs(self) -> list[Job]:
        """The warmup job of the seed program."""
        return [self.seed_program]

    def seed(self, state: DecodeState, piece: Piece) -> DecodeState:
        """Runs the seed program for a piece whose row shares its prefix's pages."""
        tokens = np.zeros(self.config.max_len, np.int32)
        tokens[:len(piece.prefix)] = piece.prefix
        i32 = np.int32
        return self.seed_program()(state, i32(piece.slot), tokens, i32(len(piece.prefix)),
                                   i32(piece.first_generated))

    def check(self, pieces: Sequence[Piece], active: np.ndarray) -> None:
        """Raises unless `pieces` fit one step beside the `active` `[B]` rows and the pool
        holds their pages (`OutOfPagesError`: nothing is allocated then)."""
        cfg, B, R = self.config, self.config.max_slots, self.config.max_prefill_batch
        total = sum(len(p.tokens) for p in pieces)
        finishing = sum(p.settings is not None for p in pieces)
        if not 0 < total <= cfg.max_prefill_len:
            raise InvalidParameterError(
                f"a step's pieces hold {total} tokens; 1 .. {cfg.max_prefill_len} fit")
        if finishing > R:
            raise InvalidParameterError(f"{finishing} prompts end in one step; at most {R}")
        if len({p.slot for p in pieces}) < len(pieces):
            raise InvalidParameterError("two pieces for one row in a step")
        for p in pieces:
            if not 0 <= p.slot < B or active[p.slot]:
                raise InvalidParameterError(f"bad or decoding row {p.slot} for a piece")
            if p.start + len(p.tokens) > cfg.max_len - 1:
                raise ContextLengthError(f"row {p.slot}: a prompt of more than "
                                         f"{cfg.max_len - 1} tokens")
            if p.prefix and len(p.prefix) != p.start:
                raise InvalidParameterError(f"row {p.slot}: a prefix of {len(p.prefix)} "
                                            f"tokens for a piece at {p.start}")
            if self.pages.owned[p.slot] * cfg.page_size < p.start:
                raise InvalidParameterError(f"row {p.slot} holds no pages for positions "
                                            f"before {p.start}")
        need = sum(self.pages.shortfall(p.slot, p.start + len(p.tokens)) for p in pieces)
        if need > self.pages.free_pages:
            raise OutOfPagesError(f"the pieces need {need} pages; {self.pages.free_pages} free")

    def pack(self, pieces: Sequence[Piece], active: np.ndarray,
             chunk: int | None = None) -> tuple[steps.ChunkInputs, list[Piece]]:
        """The chunk inputs of `pieces` (checked, pages allocated: C tokens, R finishing
        slots) and the finishing pieces, in order. chunk: C, a chunk bucket holding their
        tokens (None: the smallest)."""
        self.check(pieces, active)
        cfg, B, R = self.config, self.config.max_slots, self.config.max_prefill_batch
        for p in pieces:
            take_pages(self.pages, p.slot, p.start + len(p.tokens))
        finishing = [p for p in pieces if p.settings is not None]
        total = sum(len(p.tokens) for p in pieces)
        C = chunk if chunk is not None else cfg.chunk_bucket_for(total)
        if total > C:
            raise InvalidParameterError(f"a chunk of {C} tokens for pieces of {total}")
        tokens = np.zeros(C, np.int32)
        rows = np.full(C, -1, np.int32)
        positions = np.zeros(C, np.int32)
        generated = np.zeros(C, np.bool_)
        image_rows = None if self.images is None else np.full(C, -1, np.int32)
        finish_index = np.zeros(R, np.int32)
        finish_steps = np.zeros(R, np.int32)
        finish_rows = np.full(R, B, np.int32)
        allowed = all_allowed(R, self.vocab_size)
        at = r = 0
        for p in pieces:
            m = len(p.tokens)
            tokens[at:at + m] = p.tokens
            rows[at:at + m] = p.slot
            positions[at:at + m] = np.arange(p.start, p.start + m)
            if p.first_generated:
                generated[at:at + m] = positions[at:at + m] >= p.first_generated
            if image_rows is not None:
                image_rows[at:at + m] = self.images.rows_for(p.slot, p.start, m, p.images)
            at += m
            if p.settings is not None:
                finish_index[r], finish_rows[r] = at - 1, p.slot
                finish_steps[r] = p.settings.generated
                if p.settings.first_mask is not None:
                    allowed[r] = p.settings.first_mask
                r += 1
        sampling = settings_to_arrays([p.settings for p in finishing], R, self.vocab_size)
        return steps.ChunkInputs(tokens, rows, positions, generated, finish_index, finish_rows,
                                 finish_steps, sampling, allowed, image_rows), finishing

    def cut_prompts(self, items: Sequence[tuple[int, Sequence[int], SlotSettings]],
                    sources: Sequence[Sequence[int]] | None,
                    size: int | None = None) -> collections.deque:
        """The pieces of whole prompts ((slot, ids, settings) items; an encoder-decoder's
        source on each first piece), as the (item index, Piece) queue of `plan_pieces`: at
        most `size` tokens each (None: max_prefill_len)."""
        size = size or self.config.max_prefill_len
        queue = [(i, Piece.cut(slot, ids, settings, size))
                 for i, (slot, ids, settings) in enumerate(items)]
        if sources is not None:
            queue = [(i, [dataclasses.replace(cuts[0], source=tuple(int(t) for t in src)),
                          *cuts[1:]])
                     for (i, cuts), src in zip(queue, sources, strict=True)]
        return collections.deque((i, piece) for i, cuts in queue for piece in cuts)
