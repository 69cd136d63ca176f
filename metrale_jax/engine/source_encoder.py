"""An encoder-decoder's (translation model's) sources: the encoder runs once per request and
fills its row's cross-attention buffers (`DecodeState.cross`).

A prompt's first piece carries its row's source (`Piece.source`); before the step that
prefills it, `encode` runs the encoder over up to R = max_prefill_batch such sources at once,
in the smallest source bucket that holds the longest. Host data records which encoded source
each row holds (`source_of`: an id per encode, -1 none), so a beam fork (`fork`) knows which
rows need their parent's buffers copied; `copy_pending` makes those copies in one program
before the next step or `beam_set`.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from metrale_jax.engine import steps
from metrale_jax.engine.config import EngineConfig
from metrale_jax.engine.pieces import Piece
from metrale_jax.engine.placement import StepShardings
from metrale_jax.engine.programs import Job, ProgramCache, spec
from metrale_jax.engine.state import DecodeState
from metrale_jax.errors import ContextLengthError, InvalidParameterError


def check_source(n: int, limit: int) -> None:
    """Raises if a source (encoder input) of `n` tokens cannot be held by a row whose
    buffers hold `limit` (max_source_len) positions."""
    if n < 1:
        raise InvalidParameterError("the text to translate is empty", param="messages")
    if n > limit:
        raise ContextLengthError(
            f"the text to translate has {n} tokens, but this engine holds sources of at "
            f"most {limit} tokens (--max-source-len)")


class SourceEncoder:
    """The encoder programs and which source each row holds.

    graph: the model's `Seq2SeqGraph`; state_spec, params_spec: the abstract `DecodeState`
    and params the programs take. Attributes: source_of, `[B] int64` the id of the encoded
    source row b holds (-1: none)."""

    def __init__(self, config: EngineConfig, graph: Any, cache: ProgramCache,
                 shardings: StepShardings, state_spec: DecodeState, params_spec: Any):
        self.config, self.graph, self.cache, self.shardings = config, graph, cache, shardings
        self.state_spec, self.params_spec = state_spec, params_spec
        self.source_of = np.full(config.max_slots, -1, np.int64)
        self._encoded = 0
        self._copies: list[tuple[int, int]] = []  # (dst, src) rows a fork still owes

    def encode_program(self, length: int) -> Any:
        """The encoder over R sources of `length` (a source bucket) tokens (`steps.encode`)."""
        i32, R = jnp.int32, self.config.max_prefill_batch
        fn = jax.jit(functools.partial(steps.encode, self.graph), donate_argnums=(1,),
                     out_shardings=self.shardings.state)
        return self.cache.compile(("encode", length), fn, self.params_spec, self.state_spec,
                                  spec((R,), i32), spec((R, length), i32), spec((R,), i32))

    def copy_program(self) -> Any:
        """The program that gives forked beam rows their parent's source."""
        i32, B = jnp.int32, self.config.max_slots
        fn = jax.jit(steps.copy_sources, donate_argnums=(0,), out_shardings=self.shardings.state)
        return self.cache.compile(("copy_sources",), fn, self.state_spec, spec((B,), i32),
                                  spec((B,), i32))

    def jobs(self) -> list[Job]:
        """The warmup jobs: the encoder per source bucket, and the copy program."""
        return [*(functools.partial(self.encode_program, S) for S in self.config.source_buckets),
                self.copy_program]

    def encode(self, state: DecodeState, params: Any, pieces: Sequence[Piece]) -> DecodeState:
        """Runs the encoder for the pieces that carry their row's source (R at a time, each
        group in the smallest source bucket holding its longest); state donated."""
        cfg, B, R = self.config, self.config.max_slots, self.config.max_prefill_batch
        todo = [p for p in pieces if p.source]
        for at in range(0, len(todo), R):
            group = todo[at:at + R]
            longest = max(len(p.source) for p in group)
            check_source(longest, cfg.max_source_len)
            S = next(b for b in cfg.source_buckets if longest <= b)
            rows = np.full(R, B, np.int32)
            ids = np.zeros((R, S), np.int32)
            lens = np.zeros(R, np.int32)
            for i, p in enumerate(group):
                rows[i], lens[i] = p.slot, len(p.source)
                ids[i, :len(p.source)] = p.source
                self._encoded += 1
                self.source_of[p.slot] = self._encoded
            state = self.encode_program(S)(params, state, rows, ids, lens)
        return state

    def fork(self, moves: Sequence[tuple[int, int, int]]) -> None:
        """Beam forks: each (dst, src, length) row dst takes row src's source; a copy of the
        buffers is recorded for `copy_pending` where dst holds another."""
        sources = {d: self.source_of[s] for d, s, _ in moves}
        for dst, src, _ in moves:
            if self.source_of[dst] != sources[dst]:
                self._copies.append((dst, src))
            self.source_of[dst] = sources[dst]

    def copy_pending(self, state: DecodeState) -> DecodeState:
        """Applies the source copies `fork` recorded (one program), if any; state donated."""
        if not self._copies:
            return state
        B = self.config.max_slots
        dst = np.full(B, B, np.int32)
        src = np.zeros(B, np.int32)
        for i, (d, s) in enumerate(self._copies):
            dst[i], src[i] = d, s
        self._copies = []
        return self.copy_program()(state, dst, src)

    def release(self, slot: int) -> None:
        """Row `slot` holds no source."""
        self.source_of[slot] = -1

    def release_all(self) -> None:
        """No row holds a source; no copy is owed."""
        self.source_of[:] = -1
        self._copies = []
