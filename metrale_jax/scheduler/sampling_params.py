"""`SamplingParams`: how one request is decoded and when it stops (host side, validated)."""

from __future__ import annotations

import dataclasses
import math

from metrale_jax.errors import InvalidParameterError

MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Decoding settings of one request, validated on construction.

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

    @property
    def greedy(self) -> bool:
        """True when decoding takes the most likely token every step."""
        return self.temperature == 0.0
