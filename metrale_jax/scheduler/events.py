"""The events a request's stream yields: `Token`s, then exactly one terminal event.

Terminal events: `Finished` (eos, stop, length), `Pooled` (a pooling request's vector),
`Cancelled`, `TimedOut`, `Failed`.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from metrale_jax.errors import MetraleError


@dataclasses.dataclass(frozen=True)
class TokenLogprob:
    """One generated token's logprob and its top alternatives `[(token_id, logprob), ...]`."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclasses.dataclass(frozen=True)
class Token:
    """Newly generated tokens and the text they complete (text may be "" while held back)."""

    token_ids: tuple[int, ...]
    text: str
    logprobs: tuple[TokenLogprob, ...] = ()


@dataclasses.dataclass(frozen=True)
class BeamHypothesis:
    """One finished hypothesis of a beam search: its generated ids (ending in eos when it
    stopped on one), their text, its score (sum of log-probabilities over
    generated_len ** length_penalty) and finish reason ("stop" or "length")."""

    token_ids: tuple[int, ...]
    text: str
    score: float
    finish_reason: str


@dataclasses.dataclass(frozen=True)
class Finished:
    """The request ended normally.

    finish_reason: "stop" (eos, stop token or stop string) or "length" (max_tokens or the end
    of the context). stop_reason: the matched stop string or stop token id, None for eos.
    text: any text held back until the end (already included in no `Token`).
    cached_tokens: the prompt tokens whose keys and values came from the prefix cache.
    beams: a beam search's best hypotheses, best first (num_return_sequences of them; the
        first is also what the `Token` events carried); empty otherwise.
    """

    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    stop_reason: str | int | None = None
    text: str = ""
    cached_tokens: int = 0
    beams: tuple[BeamHypothesis, ...] = ()


@dataclasses.dataclass(frozen=True, eq=False)
class Pooled:
    """A pooling request ended (`GenerationRequest.pooling`): vector `[E] float32`, the final-
    normed hidden state of its prompt's last token; prompt_tokens: the tokens it read;
    cached_tokens: those whose keys and values came from the prefix cache; mean: `[E]`
    float32, the mean of those hidden states over the prompt's tokens whose keys and values
    were computed (all of them when cached_tokens is 0: an engine without the prefix cache).
    """

    vector: np.ndarray
    prompt_tokens: int
    cached_tokens: int = 0
    mean: np.ndarray | None = None


@dataclasses.dataclass(frozen=True)
class Cancelled:
    """The request was cancelled (client gone, or the scheduler stopped)."""

    prompt_tokens: int
    completion_tokens: int
    reason: str = "cancelled"


@dataclasses.dataclass(frozen=True)
class TimedOut:
    """The request's deadline passed before it finished."""

    prompt_tokens: int
    completion_tokens: int


@dataclasses.dataclass(frozen=True)
class Failed:
    """The request failed: a user error (`MetraleError`) or an internal error."""

    error: BaseException

    @property
    def is_user_error(self) -> bool:
        """True when the error is the caller's (HTTP 4xx), False for an internal failure."""
        return isinstance(self.error, MetraleError)


Event = Token | Finished | Pooled | Cancelled | TimedOut | Failed
TERMINAL = (Finished, Pooled, Cancelled, TimedOut, Failed)
