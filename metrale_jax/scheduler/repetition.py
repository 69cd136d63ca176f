"""`RepetitionDetector`: notices when a request's output tail is one block repeated.

For each period p <= max_period it keeps the length of the current run of tokens equal to the
token p positions earlier; the tail is p-periodic over `p * min_repeats` tokens (the block
repeated `min_repeats` times) once that run reaches `p * (min_repeats - 1)`. O(max_period) per
token, no rescanning.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from metrale_jax.errors import InvalidParameterError


@dataclasses.dataclass(frozen=True)
class RepetitionDetection:
    """`repetition_detection` settings: a block of at most `max_period` tokens repeated at
    least `min_repeats` times at the end of the output ends the request."""

    max_period: int = 32
    min_repeats: int = 8

    def __post_init__(self) -> None:
        for name, low in (("max_period", 1), ("min_repeats", 2)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or not low <= v <= 4096:
                raise InvalidParameterError(
                    f"repetition_detection.{name} must be an integer in [{low}, 4096], got "
                    f"{v!r}", param=f"repetition_detection.{name}")

    @classmethod
    def parse(cls, value) -> RepetitionDetection | None:
        """From a request field: None/False = off, True = defaults, a dict or an instance."""
        if value is None or value is False:
            return None
        if value is True:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, dict):
            unknown = set(value) - {"max_period", "min_repeats"}
            if unknown:
                raise InvalidParameterError(
                    f"repetition_detection has unknown keys {sorted(unknown)}",
                    param="repetition_detection")
            return cls(**value)
        raise InvalidParameterError(
            "repetition_detection must be true, false or {\"max_period\": int, "
            f"\"min_repeats\": int}}, got {value!r}", param="repetition_detection")


class RepetitionDetector:
    """Feeds on one request's generated tokens; `push` says when the tail repeats."""

    def __init__(self, settings: RepetitionDetection):
        self.settings = settings
        P = settings.max_period
        self._periods = np.arange(1, P + 1)
        self._runs = np.zeros(P, np.int64)
        self._needed = self._periods * (settings.min_repeats - 1)
        self._tail = np.full(P + 1, -1, np.int64)  # the last P + 1 tokens, newest last

    def push(self, token: int) -> bool:
        """Adds a token; True when the output now ends with a block repeated enough."""
        self._tail[:-1] = self._tail[1:]
        self._tail[-1] = token
        earlier = self._tail[-1 - self._periods]  # the token p positions back, per p
        same = earlier == token
        self._runs = np.where(same, self._runs + 1, 0)
        return bool(np.any(self._runs >= self._needed))
