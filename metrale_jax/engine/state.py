"""The device-side decode state, a slot's host-side settings, and the per-step outputs.

`DecodeState` is one pytree donated to every compiled call that changes it: the paged KV pools
and the per-row (slot) arrays. Row `b` is decoding when the host says so (the step's `active`
mask); a row that does not advance writes to the null page and keeps its state.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from metrale_jax.engine.bitmask import pack
from metrale_jax.engine.sampling import seed_to_key
from metrale_jax.engine.sampling_state import SamplingState, TokenHistory
from metrale_jax.errors import InvalidParameterError
from metrale_jax.models.seq2seq_ragged import CrossCache
from metrale_jax.sampling_fields import (
    DEVICE_ARRAYS,
    MAX_BAD_WORD_TOKENS,
    MAX_BAD_WORDS,
    MAX_LOGIT_BIAS,
    ROW_FIELDS,
)

# Logical axis names of the per-slot arrays, beside their shapes (see engine/sharding.py).
SLOT_AXES: tuple[str, ...] = ("slots",)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeState:
    """Everything `generate` reads and writes.

    pages: the KV cache, one pool per layer `[N, ps, 2K, D]` (keys and values interleaved on
    the head axis; which pages a row holds is host data, `engine/pages.py`), or with the
    scanned layer loop one pool `[L, N, ps, 2K, D]` (`models/scanned.py`).
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
    pool_sums: [B, E] float32 with `EngineConfig.pooled_output`, each row's sum of the final-
    normed hidden states of the prompt tokens its pieces computed (mean pooling); None
    otherwise.
    """

    pages: tuple[jax.Array, ...] | jax.Array
    positions: jax.Array
    tokens: jax.Array
    steps: jax.Array
    sampling: SamplingState
    history: TokenHistory
    cross: CrossCache | None = None
    images: jax.Array | None = None
    pool_sums: jax.Array | None = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepOutput:
    """What one engine call produced, small enough to copy to the host every step.

    tokens: [k, C] int32; logprobs: [k, C] float32 (the model's log-softmax of each token);
    top_ids: [k, C, N] int32 and top_logprobs: [k, C, N] float32, the N most likely tokens.
    For a ragged step C = B + R: column b < B is decode row b's token at each of the k steps,
    column B + r (first step only) the first token of the r-th prompt finished in the step.
    For `Engine.add`, k = 1 and column `i` is the i-th added item (not its slot).
    pooled: [R, E] float32 with `EngineConfig.pooled_output`, row r the final-normed hidden
    state of the r-th prompt finished in the step at its last token (the model's
    `last_hidden_state` there); None otherwise (and for decode-only steps).
    pooled_mean: [R, E] float32 beside `pooled`, the mean of those hidden states over the
    prompt's tokens (over those its pieces computed: the whole prompt when no prefix was
    shared from the prefix cache).
    """

    tokens: jax.Array
    logprobs: jax.Array
    top_ids: jax.Array
    top_logprobs: jax.Array
    pooled: jax.Array | None = None
    pooled_mean: jax.Array | None = None

    def copy_to_host_async(self) -> None:
        """Starts copying every array to the host without waiting."""
        for leaf in jax.tree.leaves(self):
            if hasattr(leaf, "copy_to_host_async"):
                leaf.copy_to_host_async()

    def to_numpy(self) -> StepOutput:
        """The same output as NumPy arrays (waits for the device)."""
        return jax.tree.map(np.asarray, self)


def _check_limits(self) -> None:
    """The engine's static limits (the values themselves were checked by `SamplingParams`,
    the one check of each field's bound)."""
    def bad(field: str, why: str) -> InvalidParameterError:
        return InvalidParameterError(f"{field}={getattr(self, field)!r} {why}", param=field)

    if len(self.logit_bias) > MAX_LOGIT_BIAS:
        raise bad("logit_bias", f"may hold at most {MAX_LOGIT_BIAS} entries")
    if len(self.bad_words) > MAX_BAD_WORDS:
        raise bad("bad_words", f"may hold at most {MAX_BAD_WORDS} multi-token sequences")
    if any(not 2 <= len(w) <= MAX_BAD_WORD_TOKENS for w in self.bad_words):
        raise bad("bad_words", f"sequences must have 2 to {MAX_BAD_WORD_TOKENS} tokens")


SlotSettings = dataclasses.make_dataclass(
    "SlotSettings",
    [(r.name, r.type, dataclasses.field(default=r.default, compare=r.compare))
     for r in ROW_FIELDS],
    namespace={"__post_init__": _check_limits, "__doc__": (
        "One request's sampling settings, as the host hands them to `Engine.add`.\n\n"
        "The user-facing checks live in `SamplingParams`; here token ids are already "
        "resolved (eos, stop ids, bad words, DRY breakers) and sizes are checked against "
        "the static limits of `sampling_state`. `SlotSettings()` is an idle row: greedy, "
        "every control off.\n\nFields (from `metrale_jax.sampling_fields.ROW_FIELDS`):\n"
        + "\n".join(f"    {r.name} = {r.default!r}: {r.doc}" for r in ROW_FIELDS) + "\n")},
    frozen=True)
SlotSettings.__module__ = __name__


def _write_seed(s: SamplingState, i: int, seed: int, vocab_size: int) -> None:
    s.keys[i] = seed_to_key(int(seed))


def _write_bias(s: SamplingState, i: int, pairs, vocab_size: int) -> None:
    for j, (tok, value) in enumerate(pairs):
        s.bias_ids[i, j], s.bias_values[i, j] = tok, value


def _write_bad_words(s: SamplingState, i: int, words, vocab_size: int) -> None:
    for j, word in enumerate(words):
        s.bad_words[i, j, MAX_BAD_WORD_TOKENS - len(word):] = word
        s.bad_word_lens[i, j] = len(word)


def _bitmask(array: str):
    def write(s: SamplingState, i: int, ids, vocab_size: int) -> None:
        getattr(s, array)[i] = pack(ids, vocab_size)
    return write


ROW_WRITERS = {"seed": _write_seed, "logit_bias": _write_bias, "bad_words": _write_bad_words,
               "banned_ids": _bitmask("banned"), "stop_ids": _bitmask("stop_ids"),
               "dry_breaker_ids": _bitmask("dry_breakers")}
"""How the row fields that are not one number per row fill their `SamplingState` arrays;
every other array with a source is the source's value, clipped to int32 for int32 arrays."""
_SCALARS = tuple(a for a in DEVICE_ARRAYS if not a.shape and a.source not in ROW_WRITERS)
_INT32 = np.iinfo(np.int32)


def settings_to_arrays(settings: list[SlotSettings], rows: int, vocab_size: int) -> SamplingState:
    """NumPy `SamplingState` of `rows` rows: `settings` first, idle (greedy) padding after."""
    s = SamplingState.host_defaults(rows, vocab_size)
    for i, x in enumerate(settings):
        for a in _SCALARS:
            value = getattr(x, a.source)
            if a.dtype == "int32":
                value = max(_INT32.min, min(int(value), _INT32.max))
            getattr(s, a.name)[i] = value
        for name, write in ROW_WRITERS.items():
            write(s, i, getattr(x, name), vocab_size)
    return s
