"""`GrammarSlots`: the batching loop's side of constrained decoding (llguidance matchers).

Each constrained request gets a matcher at admission; its first token's mask goes into the
prefill (`SlotSettings.first_mask`). Every decode step the loop asks `step_inputs` which slots
advance and with which masks:
- A constrained slot needs its previous token consumed by its matcher before its next mask
  exists. Outputs are read one step late, so while one of its tokens is in flight the slot
  is *held*: the step runs without it (it keeps its position and state) and every other slot
  advances as usual. Unconstrained slots never wait: they lose nothing.
- When every occupied slot is constrained and waiting, there is nothing to overlap with, so
  `must_drain` tells the loop to read the outputs first; the constrained slots then advance
  every step.
A thinking budget (`Sequence.thinking`) rides on the same mechanism: near its budget the
slot waits for its in-flight tokens, and once spent its mask is the one forced token of the
end-of-thinking text, until the answer starts.
Masks are data (`[B, ceil(V/32)]` uint32, all ones for unconstrained rows): nothing compiles.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

import numpy as np

from metrale_jax.engine.bitmask import pack, words_for
from metrale_jax.errors import InvalidParameterError

if TYPE_CHECKING:
    from metrale_jax.scheduler.sequence import Sequence


class GrammarSlots:
    """Matchers and in-flight counts of one engine's slots, and each step's host masks.

    Args:
        tokenizer: the model's tokenizer (the llguidance tokenizer is built from it on first
            use, ~0.3 s).
        vocab_size: V of the engine's logits (may exceed the tokenizer's).
        num_slots: B.
    """

    def __init__(self, tokenizer, vocab_size: int, num_slots: int):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._compiler = None
        self._lock = threading.Lock()
        self.inflight = np.zeros(num_slots, np.int64)

    @property
    def compiler(self):
        """The `ConstraintCompiler` (built once, thread-safe)."""
        with self._lock:
            if self._compiler is None:
                from metrale_jax.scheduler.constraints import ConstraintCompiler
                # Compact JSON: no optional whitespace, so a model can't spend its tokens
                # on blanks (a random or weak model would) and outputs stay short.
                self._compiler = ConstraintCompiler(self.tokenizer, vocab_size=self.vocab_size,
                                                    json_whitespace="compact")
            return self._compiler

    def validate(self, constraint, decode_steps: int) -> None:
        """Raises `InvalidParameterError` for a constraint that can't be served."""
        if decode_steps > 1:
            raise InvalidParameterError(
                "constrained decoding needs an engine with decode_steps=1 (a mask per step)",
                param=constraint.param)
        self.compiler.validate(constraint)

    def start(self, constraint) -> tuple[object, np.ndarray]:
        """A fresh matcher and its first token's mask ([ceil(V/32)] uint32)."""
        matcher = self.compiler.matcher(constraint)
        row = self.compiler.allocate(1)[0]
        matcher.fill(row)
        return matcher, row.view(np.uint32)

    def mask_of(self, matcher) -> np.ndarray:
        """The next token's mask ([ceil(V/32)] uint32) of a matcher where it is now (a
        preempted request resuming)."""
        row = self.compiler.allocate(1)[0]
        matcher.fill(row)
        return row.view(np.uint32)

    def launched(self, slots: np.ndarray) -> None:
        """Slots whose next token is now in flight (`slots`: [n] int)."""
        self.inflight[slots] += 1

    def consumed(self, slot: int) -> None:
        """One in-flight output of `slot` was read."""
        self.inflight[slot] = max(0, self.inflight[slot] - 1)

    def freed(self, slot: int) -> None:
        """`slot` lost its request (its in-flight outputs will be ignored)."""
        self.inflight[slot] = 0

    def _waits(self, i: int, seq: Sequence) -> bool:
        """The slot can't advance until its in-flight tokens are read."""
        if self.inflight[i] == 0:
            return False
        return seq.matcher is not None or (
            seq.thinking is not None and seq.thinking.needs_sync(int(self.inflight[i])))

    def must_drain(self, sequences: list[Sequence | None]) -> bool:
        """True when every occupied slot has to wait for its in-flight tokens."""
        busy = [(i, s) for i, s in enumerate(sequences) if s is not None]
        return bool(busy) and all(self._waits(i, s) for i, s in busy)

    def step_inputs(self, sequences: list[Sequence | None]) -> tuple[np.ndarray, np.ndarray | None]:
        """(active [B] bool, allowed [B, W] uint32 or None) for the next decode step."""
        B = len(sequences)
        active = np.array([s is not None for s in sequences], np.bool_)
        special = [i for i, s in enumerate(sequences)
                   if s is not None and (s.matcher is not None or s.thinking is not None)]
        if not special:
            return active, None
        ready, forced = [], []
        for i in special:
            seq = sequences[i]
            if self._waits(i, seq):
                active[i] = False  # held: its last token is not read yet
            elif seq.thinking is not None and seq.thinking.forced() is not None:
                forced.append((i, seq.thinking.forced()))
            elif seq.matcher is not None:
                ready.append((seq.matcher, i))
        if not ready and not forced:
            return active, None
        # A new array every step, never a buffer refilled in place: on CPU the device array
        # made from it may share its memory, and the step it feeds can still be queued when
        # the next step's masks are written (a constrained row then sampled from a mask of
        # the step after: tokens its grammar forbids).
        mask = np.full((B, words_for(self.vocab_size)), -1, np.int32)
        if ready:
            from metrale_jax.scheduler.constraints import Matcher
            Matcher.fill_many(ready, mask)
        for i, token in forced:
            mask[i] = pack([token], self.vocab_size).view(np.int32)
        return active, mask.view(np.uint32)
