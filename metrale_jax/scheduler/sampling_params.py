"""`SamplingParams`: how one request is decoded and when it stops (host side, validated)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

from metrale_jax.engine.sampling_state import MAX_LOGIT_BIAS
from metrale_jax.errors import InvalidParameterError
from metrale_jax.scheduler.repetition import RepetitionDetection

MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_BAD_WORD_STRINGS = 16
MAX_DRY_BREAKERS = 16
DEFAULT_DRY_BREAKERS = ("\n", ":", "\"", "*")


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Decoding settings of one request, validated on construction.

    The sampler applies them in one fixed order on the device, per slot:
    penalties (repetition -> presence/frequency -> DRY -> LZ) -> logit_bias -> bans
    (bad_words) and the min_tokens mask -> top-nσ -> temperature -> top_k -> top_p -> min_p ->
    typical_p -> XTC -> the draw. Each truncation step renormalises over the tokens still kept.

    Attributes:
        max_tokens: tokens to generate at most; None = until the end of the context.
        temperature: 0 = greedy; otherwise logits are divided by it (≥ 0).
        top_k: keep the k most likely tokens (0 = off).
        top_p: keep the smallest set whose probability reaches p (0 < p ≤ 1).
        min_p: drop tokens below `min_p * p(most likely)` (0 ≤ min_p ≤ 1).
        seed: per-request seed; the same seed gives the same tokens whatever else runs.
        stop: strings that end generation (not returned unless include_stop_str_in_output).
        stop_token_ids: token ids that end generation (returned as text unless special).
        ignore_eos: keep going past the model's eos ids.
        logprobs: return the sampled token's logprob and this many top alternatives (0–20);
            None = no logprobs.
        skip_special_tokens: leave special tokens out of the text.
        include_stop_str_in_output: keep the matched stop string in the text.
        repetition_penalty: > 0; tokens of the prompt or output have a positive logit divided
            by it and a negative one multiplied (1 = off).
        presence_penalty, frequency_penalty: in [-2, 2], subtracted once per generated token
            seen / per occurrence (0 = off).
        logit_bias: token id -> bias in [-100, 100], added to the logits.
        dry_multiplier (>= 0, 0 = off), dry_base (>= 1), dry_allowed_length (>= 0),
            dry_penalty_last_n (-1 = whole context, 0 = off), dry_sequence_breakers: DRY,
            with llama.cpp's semantics.
        lz_penalty: >= 0, the LZ penalty's strength (0 = off).
        top_n_sigma: keep logits within n standard deviations of the largest (<= 0 = off).
        typical_p: in (0, 1], locally typical sampling (1 = off).
        xtc_threshold in [0, 1], xtc_probability in [0, 1] (0 = off): XTC.
        min_tokens: eos and stop_token_ids are masked until this many tokens are generated.
        bad_words: strings whose token sequences are never generated.
        repetition_detection: None (off), or a `RepetitionDetection`; True or a dict with
            max_period / min_repeats are accepted. Ends the request with finish_reason "stop"
            and stop_reason "repetition".
        constraint: None, or a `scheduler.constraints.Constraint` (JSON schema, regex,
            choice, grammar): every token is drawn from what the grammar allows.
        thinking_budget: None, or a `scheduler.thinking.ThinkingBudgetSpec`: once the
            thinking reaches its budget of tokens, the end-of-thinking tokens are forced.
        lora: the LoRA adapters the scheduler holds to serve this request with: a name (at
            weight 1), or {name: weight} (several at once, each update scaled by its weight:
            llama.cpp's per-request list; {} is the base model). None: the scheduler's active
            adapters (`Scheduler.set_active_lora`; none unless set). Kept as sorted
            (name, weight) pairs.
        num_beams: 1 (sampling or greedy, as set above), or the beams of a beam search
            (transformers' `generate(num_beams=...)` with do_sample=False: the model's raw
            log-probabilities; temperature, top-k/p and the like do not apply, and the
            controls that change the distribution or the stops are refused with it).
        length_penalty: beam search: a finished hypothesis scores sum_logprobs /
            generated_len ** length_penalty.
        early_stopping: beam search: True, False or "never" (transformers' meanings).
        num_return_sequences: beam search: how many of the best hypotheses to return
            (<= num_beams).
        speculative_tokens: speculative decoding with prompt lookup: up to this many draft
            tokens per step, copied from the sequence's own earlier text and verified in
            one forward (the output is what decoding without it gives: same tokens, same
            seed); 0 = off, None = the engine's default (`speculative_tokens`). At most the
            engine's `speculative_tokens` (checked by the scheduler); not used for
            constrained requests and beam search.
    """

    max_tokens: int | None = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Mapping[int, float] | tuple[tuple[int, float], ...] = ()
    dry_multiplier: float = 0.0
    dry_base: float = 1.75
    dry_allowed_length: int = 2
    dry_penalty_last_n: int = -1
    dry_sequence_breakers: tuple[str, ...] = DEFAULT_DRY_BREAKERS
    lz_penalty: float = 0.0
    top_n_sigma: float = 0.0
    typical_p: float = 1.0
    xtc_threshold: float = 0.1
    xtc_probability: float = 0.0
    min_tokens: int = 0
    bad_words: tuple[str, ...] = ()
    repetition_detection: RepetitionDetection | None = None
    constraint: Any = None
    thinking_budget: Any = None
    lora: str | dict[str, float] | tuple[tuple[str, float], ...] | None = None
    num_beams: int = 1
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    num_return_sequences: int = 1
    speculative_tokens: int | None = None

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> InvalidParameterError:
            return InvalidParameterError(f"{name} {why}, got {getattr(self, name)!r}", param=name)

        def number(name: str) -> float:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise bad(name, "must be a finite number")
            return float(v)

        def integer(name: str) -> int:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise bad(name, "must be an integer")
            return v

        if self.max_tokens is not None and integer("max_tokens") < 1:
            raise bad("max_tokens", "must be at least 1")
        if number("temperature") < 0:
            raise bad("temperature", "must be ≥ 0")
        if integer("top_k") < 0:
            raise bad("top_k", "must be ≥ 0 (0 = off)")
        if not 0 < number("top_p") <= 1:
            raise bad("top_p", "must be in (0, 1]")
        if not 0 <= number("min_p") <= 1:
            raise bad("min_p", "must be in [0, 1]")
        if self.seed is not None:
            integer("seed")
        if self.lora is not None:
            object.__setattr__(self, "lora", _lora_mix(self.lora, bad))
        if self.logprobs is not None and not 0 <= integer("logprobs") <= MAX_LOGPROBS:
            raise bad("logprobs", f"must be in [0, {MAX_LOGPROBS}]")
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if any(not isinstance(s, str) or not s for s in stop):
            raise bad("stop", "must be non-empty strings")
        if len(stop) > MAX_STOP_STRINGS:
            raise bad("stop", f"may hold at most {MAX_STOP_STRINGS} strings")
        object.__setattr__(self, "stop", stop)
        ids = tuple(self.stop_token_ids)
        if any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in ids):
            raise bad("stop_token_ids", "must be non-negative integers")
        object.__setattr__(self, "stop_token_ids", ids)
        self._check_controls(bad, number, integer)

    def _check_controls(self, bad, number, integer) -> None:
        if number("repetition_penalty") <= 0:
            raise bad("repetition_penalty", "must be > 0 (1 = off)")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= number(name) <= 2:
                raise bad(name, "must be in [-2, 2]")
        bias = self.logit_bias
        pairs = tuple(bias.items()) if isinstance(bias, Mapping) else tuple(bias)
        if len(pairs) > MAX_LOGIT_BIAS:
            raise bad("logit_bias", f"may hold at most {MAX_LOGIT_BIAS} entries")
        clean = []
        for pair in pairs:
            if not isinstance(pair, tuple) or len(pair) != 2:
                raise bad("logit_bias", "must map token ids to numbers")
            tok, value = pair
            if isinstance(tok, str) and tok.strip().lstrip("-").isdigit():
                tok = int(tok)
            if isinstance(tok, bool) or not isinstance(tok, int) or tok < 0:
                raise InvalidParameterError(
                    f"logit_bias keys must be token ids >= 0, got {tok!r}", param="logit_bias")
            if (isinstance(value, bool) or not isinstance(value, (int, float))
                    or not -100 <= value <= 100):
                raise InvalidParameterError(
                    f"logit_bias[{tok}] must be a number in [-100, 100], got {value!r}",
                    param="logit_bias")
            clean.append((tok, float(value)))
        if len({t for t, _ in clean}) != len(clean):
            raise bad("logit_bias", "has a token id twice")
        object.__setattr__(self, "logit_bias", tuple(clean))
        if number("dry_multiplier") < 0:
            raise bad("dry_multiplier", "must be >= 0 (0 = off)")
        if number("dry_base") < 1:
            raise bad("dry_base", "must be >= 1")
        if integer("dry_allowed_length") < 0:
            raise bad("dry_allowed_length", "must be >= 0")
        if integer("dry_penalty_last_n") < -1:
            raise bad("dry_penalty_last_n", "must be >= -1 (-1 = whole context, 0 = off)")
        breakers = self.dry_sequence_breakers
        breakers = (breakers,) if isinstance(breakers, str) else tuple(breakers)
        if any(not isinstance(b, str) or not b for b in breakers):
            raise bad("dry_sequence_breakers", "must be non-empty strings")
        if len(breakers) > MAX_DRY_BREAKERS:
            raise bad("dry_sequence_breakers", f"may hold at most {MAX_DRY_BREAKERS} strings")
        object.__setattr__(self, "dry_sequence_breakers", breakers)
        if number("lz_penalty") < 0:
            raise bad("lz_penalty", "must be >= 0 (0 = off)")
        number("top_n_sigma")
        if not 0 < number("typical_p") <= 1:
            raise bad("typical_p", "must be in (0, 1]")
        for name in ("xtc_threshold", "xtc_probability"):
            if not 0 <= number(name) <= 1:
                raise bad(name, "must be in [0, 1]")
        if integer("min_tokens") < 0:
            raise bad("min_tokens", "must be >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"must be <= max_tokens ({self.max_tokens})")
        words = (self.bad_words,) if isinstance(self.bad_words, str) else tuple(self.bad_words)
        if any(not isinstance(w, str) or not w.strip() for w in words):
            raise bad("bad_words", "must be non-empty strings")
        if len(words) > MAX_BAD_WORD_STRINGS:
            raise bad("bad_words", f"may hold at most {MAX_BAD_WORD_STRINGS} strings")
        object.__setattr__(self, "bad_words", words)
        object.__setattr__(self, "repetition_detection",
                           RepetitionDetection.parse(self.repetition_detection))
        self._check_beams(bad, integer)
        if self.speculative_tokens is not None and integer("speculative_tokens") < 0:
            raise bad("speculative_tokens", "must be >= 0 (0 = off)")

    def _check_beams(self, bad: Callable[[str, str], Exception],
                     integer: Callable[[str], int]) -> None:
        if integer("num_beams") < 1:
            raise bad("num_beams", "must be >= 1")
        if not 1 <= integer("num_return_sequences") <= self.num_beams:
            raise bad("num_return_sequences", f"must be in [1, num_beams] ({self.num_beams})")
        lp = self.length_penalty
        if isinstance(lp, bool) or not isinstance(lp, int | float) or not math.isfinite(lp):
            raise bad("length_penalty", "must be a finite number")
        if self.early_stopping not in (True, False, "never"):
            raise bad("early_stopping", 'must be true, false or "never"')
        if self.num_beams == 1:
            return
        refused = {
            "stop": bool(self.stop), "logprobs": self.logprobs is not None,
            "repetition_penalty": self.repetition_penalty != 1.0,
            "presence_penalty": self.presence_penalty != 0.0,
            "frequency_penalty": self.frequency_penalty != 0.0,
            "logit_bias": bool(self.logit_bias), "dry_multiplier": self.dry_multiplier != 0.0,
            "lz_penalty": self.lz_penalty != 0.0, "xtc_probability": self.xtc_probability > 0,
            "bad_words": bool(self.bad_words),
            "repetition_detection": self.repetition_detection is not None,
            "constraint": self.constraint is not None,
            "thinking_budget": self.thinking_budget is not None}
        for name, given in refused.items():
            if given:
                raise bad(name, "is not supported with beam search (num_beams > 1)")

    @property
    def greedy(self) -> bool:
        """True when decoding takes the most likely token every step."""
        return self.temperature == 0.0


def _lora_mix(lora: Any, bad: Callable[[str, str], Exception]) -> tuple[tuple[str, float], ...]:
    """`SamplingParams.lora` as sorted (name, weight) pairs; raises `bad` when malformed."""
    if isinstance(lora, str):
        lora = {lora: 1.0}
    elif isinstance(lora, tuple):
        lora = dict(lora)
    if not isinstance(lora, Mapping):
        raise bad("lora", "must be an adapter's name or {name: weight}")
    out = []
    for name, weight in sorted(lora.items()):
        if not isinstance(name, str) or not name:
            raise bad("lora", "must name loaded LoRA adapters")
        if isinstance(weight, bool) or not isinstance(weight, int | float) \
                or not math.isfinite(weight):
            raise bad("lora", f"the weight of {name!r} must be a finite number")
        out.append((name, float(weight)))
    return tuple(out)
