"""`Completion`: the result of one generation, as the Python API and CLI return it."""

from __future__ import annotations

import dataclasses
from typing import Any

from metrale_jax.scheduler.events import (
    BeamHypothesis,
    Cancelled,
    Failed,
    Finished,
    TimedOut,
    Token,
    TokenLogprob,
)


@dataclasses.dataclass(frozen=True)
class Completion:
    """One finished generation.

    text: the generated text (stop string excluded unless asked). token_ids: the generated ids.
    finish_reason: "stop", "length", "cancelled" or "timeout". logprobs: one entry per token
    when the request asked for logprobs, else None. beams: a beam search's best hypotheses
    (num_return_sequences, best first: the first is text / token_ids); empty otherwise.
    """

    text: str
    token_ids: tuple[int, ...]
    finish_reason: str
    prompt_tokens: int
    stop_reason: str | int | None = None
    logprobs: tuple[TokenLogprob, ...] | None = None
    beams: tuple[BeamHypothesis, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        d = dataclasses.asdict(self)
        d["token_ids"] = list(self.token_ids)
        if self.logprobs is not None:
            d["logprobs"] = [{"token_id": e.token_id, "logprob": e.logprob,
                              "top": [list(t) for t in e.top]} for e in self.logprobs]
        return d


def collect(handle) -> Completion:
    """Reads a request's events to the end and assembles its `Completion`.

    Raises the request's error if it failed.
    """
    text: list[str] = []
    ids: list[int] = []
    lps: list[TokenLogprob] = []
    want_lp = handle.request.params.logprobs is not None
    prompt_tokens = len(handle.request.prompt_ids) + len(handle.request.source)
    for event in handle:
        if isinstance(event, Token):
            text.append(event.text)
            ids.extend(event.token_ids)
            lps.extend(event.logprobs)
        elif isinstance(event, Finished):
            text.append(event.text)
            return Completion("".join(text), tuple(ids), event.finish_reason, prompt_tokens,
                              event.stop_reason, tuple(lps) if want_lp else None,
                              event.beams)
        elif isinstance(event, Cancelled):
            return Completion("".join(text), tuple(ids), "cancelled", prompt_tokens)
        elif isinstance(event, TimedOut):
            return Completion("".join(text), tuple(ids), "timeout", prompt_tokens)
        elif isinstance(event, Failed):
            raise event.error
    raise RuntimeError("the request's stream ended without a terminal event")
