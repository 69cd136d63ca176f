"""`SamplingParams`: how one request is decoded and when it stops (host side, validated).

The class is derived from `metrale_jax.sampling_fields.FIELDS`: its fields, defaults and
per-field checks come from that table; the checks that span fields (min_tokens against
max_tokens, beam search's refusals) are here.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from metrale_jax.errors import InvalidParameterError
from metrale_jax.sampling_fields import FIELDS, check, field_docs
from metrale_jax.scheduler.repetition import RepetitionDetection


def _bad(params: Any, name: str, why: str) -> InvalidParameterError:
    return InvalidParameterError(f"{name} {why}, got {getattr(params, name)!r}", param=name)


def _post_init(self: Any) -> None:
    """Checks every field against the table (normalising sequences to tuples), then the
    rules that span fields."""
    for f in FIELDS:
        object.__setattr__(self, f.name, check(f, getattr(self, f.name)))
    if self.max_tokens is not None and self.min_tokens > self.max_tokens:
        raise _bad(self, "min_tokens", f"must be <= max_tokens ({self.max_tokens})")
    object.__setattr__(self, "repetition_detection",
                       RepetitionDetection.parse(self.repetition_detection))
    if not 1 <= self.num_return_sequences <= self.num_beams:
        raise _bad(self, "num_return_sequences", f"must be in [1, num_beams] ({self.num_beams})")
    if self.num_beams == 1:
        return
    for f in FIELDS:
        if not f.with_beams and getattr(self, f.name) != f.default:
            raise _bad(self, f.name, "is not supported with beam search (num_beams > 1)")


def _greedy(self: Any) -> bool:
    """True when decoding takes the most likely token every step."""
    return self.temperature == 0.0


_DOC = f"""Decoding settings of one request, validated on construction.

The sampler applies them in one fixed order on the device, per slot:
penalties (repetition -> presence/frequency -> DRY -> LZ) -> logit_bias -> bans
(bad_words) and the min_tokens mask -> top-nσ -> temperature -> top_k -> top_p -> min_p ->
typical_p -> XTC -> the draw. Each truncation step renormalises over the tokens still kept.

Fields (from `metrale_jax.sampling_fields.FIELDS`; name: type = default: meaning; bound):
{field_docs()}

lora is kept as sorted (name, weight) pairs, logit_bias as (id, bias) pairs, stop /
bad_words / dry_sequence_breakers as tuples. Beam search (num_beams > 1) follows
transformers' `generate(num_beams=...)` with do_sample=False (the model's raw
log-probabilities) and refuses the controls that change the distribution or the stops.
speculative_tokens is at most the engine's own (checked by the scheduler).
"""

SamplingParams = dataclasses.make_dataclass(
    "SamplingParams",
    [(f.name, f.type, dataclasses.field(default=f.default)) for f in FIELDS],
    namespace={"__post_init__": _post_init, "greedy": property(_greedy), "__doc__": _DOC},
    frozen=True)
SamplingParams.__module__ = __name__
