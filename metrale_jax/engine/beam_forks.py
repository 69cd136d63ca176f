"""Beam search on the engine side: forking rows and moving beams between two decode steps.

`fork` is host data: a child row shares its parent's full pages (`PageTable.fork`) and gets a
page of its own for a partly written last page, whose copy it owes; its length, adapters and
(an encoder-decoder's) source become the parent's. `beam_set` then runs one program that
makes the owed page copies and sets each beam row's next input (`steps.beam_set`), whatever
the rows and copies. The scheduler's beam rows decide the moves (`scheduler/beam.py`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from metrale_jax.engine import steps
from metrale_jax.engine.config import EngineConfig
from metrale_jax.engine.lora_slots import LoraSlots
from metrale_jax.engine.pages import PageTable
from metrale_jax.engine.placement import StepShardings
from metrale_jax.engine.programs import Job, ProgramCache, spec
from metrale_jax.engine.source_encoder import SourceEncoder
from metrale_jax.engine.state import DecodeState


class BeamForks:
    """Forks of beam rows and the `beam_set` program.

    pages, lengths: the engine's `PageTable` and its host mirror of each row's length (`[B]`,
    changed in place); lora: the `LoraSlots` (a child takes its parent's mix); sources: the
    `SourceEncoder` of an encoder-decoder, else None; state_spec: the abstract `DecodeState`."""

    def __init__(self, config: EngineConfig, pages: PageTable, lengths: np.ndarray,
                 lora: LoraSlots, sources: SourceEncoder | None, cache: ProgramCache,
                 shardings: StepShardings, state_spec: DecodeState):
        self.config, self.pages, self.lengths = config, pages, lengths
        self.lora, self.sources = lora, sources
        self.cache, self.shardings, self.state_spec = cache, shardings, state_spec

    def program(self) -> Any:
        """The program that moves beam rows between two decode steps (`steps.beam_set`)."""
        i32, B = jnp.int32, self.config.max_slots
        fn = jax.jit(steps.beam_set, donate_argnums=(0,), out_shardings=self.shardings.state)
        return self.cache.compile(("beam_set",), fn, self.state_spec, spec((B,), jnp.bool_),
                                  spec((B,), i32), spec((B,), i32), spec((B,), i32),
                                  spec((B,), i32))

    def jobs(self) -> list[Job]:
        """The warmup job of `beam_set` (beam search needs decode_steps 1; none otherwise)."""
        return [self.program] if self.config.decode_steps == 1 else []

    def fork(self, moves: Sequence[tuple[int, int, int]]) -> list[tuple[int, int]]:
        """For each (dst, src, length), row dst takes row src's first `length` positions: it
        shares src's full pages among them (as they were before the call) and gets a page of
        its own for a partly written last one, to be copied from src's (`beam_set`); its
        length, adapters and source become src's. Returns the (src page, dst page) copies."""
        ps = self.config.page_size
        moves = [(int(d), int(s), int(n)) for d, s, n in moves]
        partial = [(d, int(self.pages.table[s, n // ps]), n) for d, s, n in moves if n % ps]
        mix = {d: self.lora.mix[s].copy() for d, s, _ in moves}
        self.pages.fork([(d, s, n // ps) for d, s, n in moves])
        copies = []
        for dst, src_page, n in partial:
            if not self.pages.ensure(dst, n):
                raise RuntimeError("the KV page pool has no page left for a forked beam")
            copies.append((src_page, int(self.pages.table[dst, n // ps])))
        for dst, _, n in moves:
            self.lengths[dst] = n
            self.lora.mix[dst] = mix[dst]
        if self.sources is not None:
            self.sources.fork(moves)  # its buffer copies are made by the next beam_set
        return copies

    def beam_set(self, state: DecodeState, rows: Sequence[tuple[int, int, int]],
                 copies: Sequence[tuple[int, int]]) -> DecodeState:
        """Each (slot, token, position) of `rows` feeds `token` at `position` next; each (src,
        dst) of `copies` copies page src onto page dst (from `fork`). State donated."""
        B = self.config.max_slots
        if self.sources is not None:
            state = self.sources.copy_pending(state)
        mask = np.zeros(B, np.bool_)
        tokens = np.zeros(B, np.int32)
        positions = np.zeros(B, np.int32)
        src = np.zeros(B, np.int32)
        dst = np.zeros(B, np.int32)
        for slot, token, position in rows:
            mask[slot], tokens[slot], positions[slot] = True, token, position
        for i, (a, b) in enumerate(copies):
            src[i], dst[i] = a, b
        return self.program()(state, mask, tokens, positions, src, dst)
