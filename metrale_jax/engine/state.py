"""The device-side decode state, a slot's host-side settings, and the per-step outputs.

`DecodeState` is one pytree donated to every compiled call that changes it: the paged KV pools
and the per-row (slot) arrays. Row `b` is decoding when the host says so (the step's `active`
mask); a row that does not advance writes to the null page and keeps its state.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np

from metrale_jax.engine.bitmask import pack
from metrale_jax.engine.sampling import seed_to_key
from metrale_jax.engine.sampling_state import (
    MAX_BAD_WORD_TOKENS,
    MAX_BAD_WORDS,
    MAX_LOGIT_BIAS,
    SamplingState,
    TokenHistory,
)
from metrale_jax.errors import InvalidParameterError
from metrale_jax.models.seq2seq_ragged import CrossCache

# Logical axis names of the per-slot arrays, beside their shapes (see engine/sharding.py).
SLOT_AXES: tuple[str, ...] = ("slots",)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeState:
    """Everything `generate` reads and writes.

    pages: the KV cache, one pool per layer `[N, ps, 2K, D]` (keys and values interleaved on
    the head axis; which pages a row holds is host data, `engine/pages.py`).
    positions: [B] int32, where the next token goes (= the slot's current length).
    tokens: [B] int32, the last sampled token: the input of the next step.
    steps: [B] int32, the sampling step index of the next token (the first token is step 0) =
    the tokens generated so far.
    sampling: per-slot `SamplingState` ([B] rows).
    history: per-slot `TokenHistory` (tokens [B, S], counts and prompt_seen [B, V]) for the
    penalties; a slot's tokens up to its position are valid.
    cross: an encoder-decoder's per-row source (`CrossCache`: cross-attention keys and values
    L x [B, S_src, H, D] and lengths [B]); None for a decoder-only model.
    images: a vision-language model's image feature pool `[I * T_img, E]` (I images of T_img
    features each, written by the vision program at admission and read by the prompt
    pieces holding their placeholder tokens); None for a text-only model.
    """

    pages: tuple[jax.Array, ...]
    positions: jax.Array
    tokens: jax.Array
    steps: jax.Array
    sampling: SamplingState
    history: TokenHistory
    cross: CrossCache | None = None
    images: jax.Array | None = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepOutput:
    """What one engine call produced, small enough to copy to the host every step.

    tokens: [k, C] int32; logprobs: [k, C] float32 (the model's log-softmax of each token);
    top_ids: [k, C, N] int32 and top_logprobs: [k, C, N] float32, the N most likely tokens.
    For a ragged step C = B + R: column b < B is decode row b's token at each of the k steps,
    column B + r (first step only) the first token of the r-th prompt finished in the step.
    For `Engine.add`, k = 1 and column `i` is the i-th added item (not its slot).
    """

    tokens: jax.Array
    logprobs: jax.Array
    top_ids: jax.Array
    top_logprobs: jax.Array

    def copy_to_host_async(self) -> None:
        """Starts copying every array to the host without waiting."""
        for leaf in jax.tree.leaves(self):
            if hasattr(leaf, "copy_to_host_async"):
                leaf.copy_to_host_async()

    def to_numpy(self) -> StepOutput:
        """The same output as NumPy arrays (waits for the device)."""
        return jax.tree.map(np.asarray, self)


@dataclasses.dataclass(frozen=True)
class SlotSettings:
    """One request's sampling settings, as the host hands them to `Engine.add`.

    The user-facing checks live in `SamplingParams`; these are the engine's: token ids are
    already resolved (eos, stop ids, bad words, DRY breakers) and sizes are within the static
    limits of `sampling_state`.
    temperature: 0 = greedy; top_k: 0 = off; top_p in (0, 1]; min_p in [0, 1];
    seed: any integer (64 bits kept); the same seed gives the same tokens.
    typical_p (1 = off), xtc_threshold / xtc_probability (0 = off), top_n_sigma (<= 0 = off);
    repetition_penalty (1 = off), presence/frequency_penalty (0 = off), dry_* (multiplier 0 =
    off), lz_penalty (0 = off); logit_bias: (token id, bias) pairs; banned_ids: never
    sampled; min_tokens with stop_ids: those ids are masked until min_tokens are generated;
    bad_words: token sequences of 2+ tokens whose last token is banned after the rest;
    dry_breaker_ids: tokens that cut DRY's matches; first_mask: the first token's grammar
    bitmask ([ceil(V/32)] uint32; None = unconstrained); generated: tokens the request
    generated before it was preempted (its prompt is then fed again with them: they count
    as generated for the penalties, and its next token samples step `generated`).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int = 0
    typical_p: float = 1.0
    xtc_threshold: float = 0.1
    xtc_probability: float = 0.0
    top_n_sigma: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    dry_multiplier: float = 0.0
    dry_base: float = 1.75
    dry_allowed_length: int = 2
    dry_penalty_last_n: int = -1
    dry_breaker_ids: tuple[int, ...] = ()
    lz_penalty: float = 0.0
    min_tokens: int = 0
    stop_ids: tuple[int, ...] = ()
    logit_bias: tuple[tuple[int, float], ...] = ()
    banned_ids: tuple[int, ...] = ()
    bad_words: tuple[tuple[int, ...], ...] = ()
    first_mask: np.ndarray | None = dataclasses.field(default=None, compare=False)
    generated: int = 0

    def __post_init__(self) -> None:
        def bad(field: str, why: str) -> InvalidParameterError:
            return InvalidParameterError(f"{field}={getattr(self, field)!r} {why}", param=field)

        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise bad("temperature", "must be a finite number >= 0")
        if int(self.top_k) != self.top_k or self.top_k < 0:
            raise bad("top_k", "must be an integer >= 0 (0 = off)")
        if not 0 < self.top_p <= 1:
            raise bad("top_p", "must be in (0, 1]")
        if not 0 <= self.min_p <= 1:
            raise bad("min_p", "must be in [0, 1]")
        if int(self.seed) != self.seed:
            raise bad("seed", "must be an integer")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise bad("logit_bias", f"may hold at most {MAX_LOGIT_BIAS} entries")
        if len(self.bad_words) > MAX_BAD_WORDS:
            raise bad("bad_words", f"may hold at most {MAX_BAD_WORDS} multi-token sequences")
        if any(not 2 <= len(w) <= MAX_BAD_WORD_TOKENS for w in self.bad_words):
            raise bad("bad_words", f"sequences must have 2 to {MAX_BAD_WORD_TOKENS} tokens")


def settings_to_arrays(settings: list[SlotSettings], rows: int, vocab_size: int) -> SamplingState:
    """NumPy `SamplingState` of `rows` rows: `settings` first, greedy padding after."""
    s = SamplingState.host_defaults(rows, vocab_size)
    scalars = ("temperature", "top_p", "min_p", "typical_p", "xtc_threshold", "xtc_probability",
               "top_n_sigma", "repetition_penalty", "presence_penalty", "frequency_penalty",
               "dry_multiplier", "dry_base", "dry_allowed_length", "lz_penalty", "min_tokens")
    for i, x in enumerate(settings):
        for name in scalars:
            getattr(s, name)[i] = getattr(x, name)
        s.top_k[i] = min(int(x.top_k), np.iinfo(np.int32).max)
        s.dry_last_n[i] = max(-1, min(int(x.dry_penalty_last_n), np.iinfo(np.int32).max))
        s.keys[i] = seed_to_key(int(x.seed))
        for j, (tok, value) in enumerate(x.logit_bias):
            s.bias_ids[i, j], s.bias_values[i, j] = tok, value
        s.banned[i] = pack(x.banned_ids, vocab_size)
        s.stop_ids[i] = pack(x.stop_ids, vocab_size)
        s.dry_breakers[i] = pack(x.dry_breaker_ids, vocab_size)
        for j, word in enumerate(x.bad_words):
            s.bad_words[i, j, MAX_BAD_WORD_TOKENS - len(word):] = word
            s.bad_word_lens[i, j] = len(word)
    return s
