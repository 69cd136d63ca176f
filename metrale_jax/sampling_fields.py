"""The one table of a request's sampling fields, from the HTTP body to the device arrays.

A setting travels in four shapes, each derived from the tables below:

- the HTTP request models (`serving/http/protocol.py`, the Responses and Anthropic request
  models) and the CLI's sampling flags, from `SPELLINGS` (each API's name for a field, its
  own narrower bound or default);
- `SamplingParams` (`scheduler/sampling_params.py`), the validated host-side settings, from
  `FIELDS`: one default and one bound per field, checked once by `check`;
- `SlotSettings` (`engine/state.py`), one row's settings as the engine takes them, from
  `ROW_FIELDS`: the device-side fields of `FIELDS` plus what the host resolves to token ids;
- `SamplingState` (`engine/sampling_state.py`), the per-row device arrays, from
  `DEVICE_ARRAYS` (each with its dtype, shape, idle value and the row field it comes from).

Adding a knob: one `SamplingField` line (and one `DeviceArray` line when the device reads
it), its spellings, and the processor that reads it (`reader`). `tests/test_sampling_fields.py`
walks every field from a JSON body to what reads it and fails when one shape lacks it.

Defaults: `default` is what a request gets when it leaves the field out (`SamplingParams()`,
an HTTP body without it). `idle` is the value of a row with nothing set (`SlotSettings()`,
the padding rows of a step): the same except `temperature`, whose idle value 0 (greedy) is
what the engine's direct callers and the padding rows have always had, while requests
default to 1.0 (OpenAI's). The CLI's `metrale generate` defaults to greedy too (its spelling
says so). Lives beside `config.py` so the engine (which may import config, errors and models
and nothing above), the scheduler and the HTTP layer all read the same table.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any, Literal

from metrale_jax.errors import InvalidParameterError

MAX_LOGPROBS = 20
"""Top alternatives a request may ask per token."""
MAX_STOP_STRINGS = 16
"""Stop strings per request."""
MAX_BAD_WORD_STRINGS = 16
"""`bad_words` strings per request."""
MAX_DRY_BREAKERS = 16
"""DRY sequence breakers per request."""
DEFAULT_DRY_BREAKERS = ("\n", ":", "\"", "*")
"""llama.cpp's default DRY sequence breakers."""
MAX_LOGIT_BIAS = 256
"""Entries of `logit_bias` one request may carry (a static device shape)."""
MAX_BAD_WORDS = 32
"""Multi-token `bad_words` sequences (after tokenizing each word's variants) per request."""
MAX_BAD_WORD_TOKENS = 16
"""Tokens of one bad-word sequence."""

Kind = Literal["number", "integer", "flag", "object"]
SAME: Any = object()
"""Sentinel: `idle` is the field's `default`; a spelling's bound or default is the field's."""
REQUIRED: Any = object()
"""Sentinel: a spelling that the API requires (no default)."""


@dataclasses.dataclass(frozen=True)
class Bound:
    """An interval `low <= v <= high` (`<` at an open end; None = unbounded)."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False

    def contains(self, v: float) -> bool:
        """True when `v` lies in the interval."""
        if self.low is not None and (v <= self.low if self.low_open else v < self.low):
            return False
        return self.high is None or (v < self.high if self.high_open else v <= self.high)

    def text(self) -> str:
        """The rule as an error message says it: "must be in (0, 1]", "must be >= 0"."""
        lo, hi = f"{self.low:g}" if self.low is not None else "", f"{self.high:g}" \
            if self.high is not None else ""
        if self.low is not None and self.high is not None:
            return f"must be in {'(' if self.low_open else '['}{lo}, {hi}" \
                   f"{')' if self.high_open else ']'}"
        if self.low is not None:
            return f"must be {'>' if self.low_open else '>='} {lo}"
        return f"must be {'<' if self.high_open else '<='} {hi}"

    def pydantic(self) -> dict[str, float]:
        """The interval as pydantic `Field` constraints (ge / gt / le / lt)."""
        out: dict[str, float] = {}
        if self.low is not None:
            out["gt" if self.low_open else "ge"] = self.low
        if self.high is not None:
            out["lt" if self.high_open else "le"] = self.high
        return out


Normaliser = Callable[[Any, Callable[[str], Exception]], Any]
"""A field's own check: (value, bad) -> the stored value; `bad(why)` makes its 400."""


@dataclasses.dataclass(frozen=True)
class SamplingField:
    """One request setting (a `SamplingParams` field).

    name: the field (and its usual JSON name); type: its annotation; default: a request's
    value when unset; kind: how `check` reads it ("number": finite int or float; "integer";
    "flag" and "object": not checked here; `normalise` checks "object" fields); bound: the
    values allowed (None: any); nullable: None is allowed (= unset / off); note: what the
    special values mean, appended to a bound's error; row: the `SlotSettings` field of the
    same name carries it to the engine (with `row_type`; `idle` its value in an idle row);
    with_beams: False when beam search refuses a non-default value; reader: the dotted path
    of the function or class that reads it (a device processor or a host-side one); doc:
    one line for `SamplingParams`' docstring and the CLI's help.
    """

    name: str
    type: Any
    default: Any
    doc: str
    reader: str
    kind: Kind = "number"
    bound: Bound | None = None
    nullable: bool = False
    note: str = ""
    normalise: Normaliser | None = None
    row: bool = False
    row_type: Any = None
    idle: Any = SAME
    with_beams: bool = True

    @property
    def idle_value(self) -> Any:
        """The value of an idle row (`SlotSettings()`, padding rows)."""
        return self.default if self.idle is SAME else self.idle


def _strings(limit: int, what: str = "strings") -> Normaliser:
    """A str or a sequence of non-empty strings, at most `limit`, as a tuple."""
    def normalise(value: Any, bad: Callable[[str], Exception]) -> tuple[str, ...]:
        items = (value,) if isinstance(value, str) else tuple(value)
        if any(not isinstance(s, str) or not s for s in items):
            raise bad("must be non-empty strings")
        if len(items) > limit:
            raise bad(f"may hold at most {limit} {what}")
        return items
    return normalise


def _bad_words(value: Any, bad: Callable[[str], Exception]) -> tuple[str, ...]:
    words = (value,) if isinstance(value, str) else tuple(value)
    if any(not isinstance(w, str) or not w.strip() for w in words):
        raise bad("must be non-empty strings")
    if len(words) > MAX_BAD_WORD_STRINGS:
        raise bad(f"may hold at most {MAX_BAD_WORD_STRINGS} strings")
    return words


def _token_ids(value: Any, bad: Callable[[str], Exception]) -> tuple[int, ...]:
    ids = tuple(value)
    if any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in ids):
        raise bad("must be non-negative integers")
    return ids


def _logit_bias(value: Any, bad: Callable[[str], Exception]) -> tuple[tuple[int, float], ...]:
    """{token id: bias} or (id, bias) pairs as pairs; ids may be decimal strings (JSON)."""
    pairs = tuple(value.items()) if isinstance(value, Mapping) else tuple(value)
    if len(pairs) > MAX_LOGIT_BIAS:
        raise bad(f"may hold at most {MAX_LOGIT_BIAS} entries")
    clean = []
    for pair in pairs:
        if not isinstance(pair, tuple) or len(pair) != 2:
            raise bad("must map token ids to numbers")
        tok, bias = pair
        if isinstance(tok, str) and tok.strip().lstrip("-").isdigit():
            tok = int(tok)
        if isinstance(tok, bool) or not isinstance(tok, int) or tok < 0:
            raise InvalidParameterError(
                f"logit_bias keys must be token ids >= 0, got {tok!r}", param="logit_bias")
        if isinstance(bias, bool) or not isinstance(bias, int | float) or not -100 <= bias <= 100:
            raise InvalidParameterError(
                f"logit_bias[{tok}] must be a number in [-100, 100], got {bias!r}",
                param="logit_bias")
        clean.append((tok, float(bias)))
    if len({t for t, _ in clean}) != len(clean):
        raise bad("has a token id twice")
    return tuple(clean)


def _lora(value: Any, bad: Callable[[str], Exception]) -> tuple[tuple[str, float], ...]:
    """A name (weight 1), {name: weight} or (name, weight) pairs as sorted pairs."""
    if isinstance(value, str):
        value = {value: 1.0}
    elif isinstance(value, tuple):
        value = dict(value)
    if not isinstance(value, Mapping):
        raise bad("must be an adapter's name or {name: weight}")
    out = []
    for name, weight in sorted(value.items()):
        if not isinstance(name, str) or not name:
            raise bad("must name loaded LoRA adapters")
        if isinstance(weight, bool) or not isinstance(weight, int | float) \
                or not math.isfinite(weight):
            raise bad(f"the weight of {name!r} must be a finite number")
        out.append((name, float(weight)))
    return tuple(out)


def _early_stopping(value: Any, bad: Callable[[str], Exception]) -> bool | str:
    if value not in (True, False, "never"):
        raise bad('must be true, false or "never"')
    return value


_ENGINE = "metrale_jax.engine"
_TRUNCATE = f"{_ENGINE}.truncation.truncate"
_PROC = f"{_ENGINE}.logits_processors"
_SEQ = "metrale_jax.scheduler.sequence.Sequence"
_BEAM = "metrale_jax.scheduler.beam.BeamSearch"
_F = SamplingField
_AT_LEAST_0 = Bound(0)

FIELDS: tuple[SamplingField, ...] = (
    _F("max_tokens", int | None, 16, "tokens to generate at most; None = until the end of "
       "the context", _SEQ, "integer", Bound(1), nullable=True),
    _F("temperature", float, 1.0, "0 = greedy; otherwise logits are divided by it",
       f"{_ENGINE}.sampling.sample", bound=_AT_LEAST_0, row=True, row_type=float, idle=0.0),
    _F("top_k", int, 0, "keep the k most likely tokens (0 = off)", _TRUNCATE, "integer",
       _AT_LEAST_0, note="(0 = off)", row=True, row_type=int),
    _F("top_p", float, 1.0, "nucleus sampling: keep the smallest set whose probability "
       "reaches p (1 = off)", _TRUNCATE, bound=Bound(0, 1, low_open=True), row=True,
       row_type=float),
    _F("min_p", float, 0.0, "drop tokens below min_p * p(most likely) (0 = off)", _TRUNCATE,
       bound=Bound(0, 1), row=True, row_type=float),
    _F("seed", int | None, None, "per-request seed: the same seed gives the same tokens "
       "whatever else runs (None: the scheduler draws one)", f"{_ENGINE}.sampling.step_keys",
       "integer", nullable=True, row=True, row_type=int, idle=0),
    _F("stop", tuple[str, ...], (), "strings that end generation (not returned unless "
       "include_stop_str_in_output)", "metrale_jax.scheduler.stop_checker.StopChecker",
       "object", normalise=_strings(MAX_STOP_STRINGS), with_beams=False),
    _F("stop_token_ids", tuple[int, ...], (), "token ids that end generation (returned as "
       "text unless special)", _SEQ, "object", normalise=_token_ids),
    _F("ignore_eos", bool, False, "keep going past the model's eos ids", _SEQ, "flag"),
    _F("logprobs", int | None, None, "the sampled token's logprob and this many top "
       "alternatives (0-20); None = no logprobs", f"{_SEQ}.add_token", "integer",
       Bound(0, MAX_LOGPROBS), nullable=True, with_beams=False),
    _F("skip_special_tokens", bool, True, "leave special tokens out of the text",
       "metrale_jax.text.IncrementalDetokenizer", "flag"),
    _F("include_stop_str_in_output", bool, False, "keep the matched stop string in the text",
       "metrale_jax.scheduler.stop_checker.StopChecker", "flag"),
    _F("repetition_penalty", float, 1.0, "divide positive / multiply negative logits of "
       "prompt and output tokens (1 = off)", f"{_PROC}.repetition", bound=Bound(0, low_open=True),
       note="(1 = off)", row=True, row_type=float, with_beams=False),
    _F("presence_penalty", float, 0.0, "OpenAI presence penalty in [-2, 2] (0 = off)",
       f"{_PROC}.presence_frequency", bound=Bound(-2, 2), row=True, row_type=float,
       with_beams=False),
    _F("frequency_penalty", float, 0.0, "OpenAI frequency penalty in [-2, 2] (0 = off)",
       f"{_PROC}.presence_frequency", bound=Bound(-2, 2), row=True, row_type=float,
       with_beams=False),
    _F("logit_bias", Mapping[int, float] | tuple[tuple[int, float], ...], (),
       "token id -> bias in [-100, 100], added to the logits", f"{_PROC}.bias", "object",
       normalise=_logit_bias, row=True, row_type=tuple[tuple[int, float], ...],
       with_beams=False),
    _F("dry_multiplier", float, 0.0, "DRY penalty strength (0 = off)", f"{_PROC}.dry",
       bound=_AT_LEAST_0, note="(0 = off)", row=True, row_type=float, with_beams=False),
    _F("dry_base", float, 1.75, "DRY exponential base", f"{_PROC}.dry", bound=Bound(1),
       row=True, row_type=float),
    _F("dry_allowed_length", int, 2, "DRY: repeats up to this length are free", f"{_PROC}.dry",
       "integer", _AT_LEAST_0, row=True, row_type=int),
    _F("dry_penalty_last_n", int, -1, "DRY: tokens to scan (-1 = whole context, 0 = off)",
       f"{_PROC}.dry", "integer", Bound(-1), note="(-1 = whole context, 0 = off)", row=True,
       row_type=int),
    _F("dry_sequence_breakers", tuple[str, ...], DEFAULT_DRY_BREAKERS, "strings that cut "
       "DRY's matches", f"{_PROC}.dry", "object", normalise=_strings(MAX_DRY_BREAKERS)),
    _F("lz_penalty", float, 0.0, "LZ penalty strength (0 = off)", f"{_PROC}.lz_penalty",
       bound=_AT_LEAST_0, note="(0 = off)", row=True, row_type=float, with_beams=False),
    _F("top_n_sigma", float, 0.0, "keep logits within n standard deviations of the top "
       "(<= 0 = off)", f"{_PROC}.top_n_sigma", row=True, row_type=float),
    _F("typical_p", float, 1.0, "locally typical sampling mass (1 = off)", _TRUNCATE,
       bound=Bound(0, 1, low_open=True), row=True, row_type=float),
    _F("xtc_threshold", float, 0.1, "XTC: tokens at or above this probability are excluded",
       _TRUNCATE, bound=Bound(0, 1), row=True, row_type=float),
    _F("xtc_probability", float, 0.0, "XTC: chance per step to exclude them (0 = off)",
       _TRUNCATE, bound=Bound(0, 1), row=True, row_type=float, with_beams=False),
    _F("min_tokens", int, 0, "eos and stop ids are masked until this many tokens",
       f"{_PROC}.masks", "integer", _AT_LEAST_0, row=True, row_type=int),
    _F("bad_words", tuple[str, ...], (), "strings whose token sequences are never generated",
       f"{_PROC}.masks", "object", normalise=_bad_words, with_beams=False),
    _F("repetition_detection", Any, None, "None (off), or a `RepetitionDetection` (True or "
       "{max_period, min_repeats} accepted): stop_reason \"repetition\"",
       "metrale_jax.scheduler.repetition.RepetitionDetector", "object", with_beams=False),
    _F("constraint", Any, None, "None, or a `Constraint` (JSON schema, regex, choice, "
       "grammar) every token is drawn from", "metrale_jax.scheduler.grammar_slots.GrammarSlots",
       "object", with_beams=False),
    _F("thinking_budget", Any, None, "None, or a `ThinkingBudgetSpec`: end-of-thinking "
       "tokens are forced at the budget", "metrale_jax.scheduler.thinking.ThinkingBudget",
       "object", with_beams=False),
    _F("lora", str | dict[str, float] | tuple[tuple[str, float], ...] | None, None,
       "adapters: a name, or {name: weight} ({}: the base model); None: the scheduler's "
       "active ones", f"{_SEQ}.__init__", "object", nullable=True, normalise=_lora),
    _F("num_beams", int, 1, "beam search over this many beams (1 = off; transformers' "
       "num_beams)", _BEAM, "integer", Bound(1)),
    _F("length_penalty", float, 1.0, "beam search: score = logprob sum / length ** this",
       _BEAM),
    _F("early_stopping", bool | str, False, "beam search: True, False or \"never\" "
       "(transformers' meanings)", _BEAM, "object", normalise=_early_stopping),
    _F("num_return_sequences", int, 1, "beam search: the best hypotheses returned "
       "(<= num_beams)", f"{_BEAM}.results", "integer"),
    _F("speculative_tokens", int | None, None, "prompt-lookup draft tokens per step (0 = off, "
       "None = the engine's default)", "metrale_jax.scheduler.ngram_draft.propose", "integer",
       _AT_LEAST_0, nullable=True, note="(0 = off)"),
)
"""Every `SamplingParams` field, in its order."""

FIELD: dict[str, SamplingField] = {f.name: f for f in FIELDS}


def check(field: SamplingField, value: Any) -> Any:
    """`value` of `field` checked against the table (kind, bound, normaliser): the value to
    store. Raises `InvalidParameterError` naming the field (an HTTP 400)."""
    def bad(why: str) -> InvalidParameterError:
        return InvalidParameterError(f"{field.name} {why}, got {value!r}", param=field.name)

    if value is None and field.nullable:
        return None
    if field.kind == "number":
        if isinstance(value, bool) or not isinstance(value, int | float) \
                or not math.isfinite(value):
            raise bad("must be a finite number")
    elif field.kind == "integer" and (isinstance(value, bool) or not isinstance(value, int)):
        raise bad("must be an integer")
    if field.bound is not None and not field.bound.contains(value):
        raise bad(f"{field.bound.text()} {field.note}".rstrip())
    return field.normalise(value, bad) if field.normalise is not None else value


@dataclasses.dataclass(frozen=True)
class RowField:
    """A `SlotSettings` field the host resolves (token ids) or the engine alone sets.

    sources: the `SamplingParams` fields it is made from (empty: set by the scheduler)."""

    name: str
    type: Any
    default: Any
    doc: str
    sources: tuple[str, ...] = ()
    compare: bool = True


RESOLVED_ROWS: tuple[RowField, ...] = (
    RowField("dry_breaker_ids", tuple[int, ...], (), "tokens that cut DRY's matches",
             ("dry_sequence_breakers",)),
    RowField("stop_ids", tuple[int, ...], (), "stop_token_ids and eos (unless ignore_eos): "
             "masked until min_tokens are generated", ("stop_token_ids", "ignore_eos")),
    RowField("banned_ids", tuple[int, ...], (), "never sampled (one-token bad words)",
             ("bad_words",)),
    RowField("bad_words", tuple[tuple[int, ...], ...], (), "token sequences of 2+ tokens "
             "whose last token is banned after the rest", ("bad_words",)),
    RowField("first_mask", Any, None, "the first token's grammar bitmask ([ceil(V/32)] "
             "uint32; None = unconstrained)", ("constraint",), compare=False),
    RowField("generated", int, 0, "tokens generated before a preemption (they count as "
             "generated for the penalties; the next token samples step `generated`)"),
)
"""The `SlotSettings` fields the host resolves to token ids, or the scheduler sets."""

ROW_FIELDS: tuple[RowField, ...] = (
    *(RowField(f.name, f.row_type, f.idle_value, f.doc, (f.name,)) for f in FIELDS if f.row),
    *RESOLVED_ROWS)
"""`SlotSettings`' fields, in order: the row fields of `FIELDS`, then the resolved ones."""


@dataclasses.dataclass(frozen=True)
class DeviceArray:
    """One `SamplingState` array: `[R, *shape]` of `dtype`, idle rows filled with `fill`.

    source: the `SlotSettings` field written into it; shape: names of static sizes ("W" =
    ceil(V/32) bitmask words, or a MAX_* constant of this module) or ints; fill: a number,
    "V" (the vocabulary size), or `SAME` (the source row field's default)."""

    name: str
    dtype: str
    source: str
    doc: str
    shape: tuple[str | int, ...] = ()
    fill: Any = SAME


_A = DeviceArray
DEVICE_ARRAYS: tuple[DeviceArray, ...] = (
    _A("temperature", "float32", "temperature", "0 = greedy"),
    _A("top_k", "int32", "top_k", "0 = off"),
    _A("top_p", "float32", "top_p", "in (0, 1]"),
    _A("min_p", "float32", "min_p", "in [0, 1]"),
    _A("keys", "uint32", "seed", "raw threefry data of the row's seed", (2,), 0),
    _A("repetition_penalty", "float32", "repetition_penalty", "1 = off"),
    _A("presence_penalty", "float32", "presence_penalty", "0 = off"),
    _A("frequency_penalty", "float32", "frequency_penalty", "0 = off"),
    _A("dry_multiplier", "float32", "dry_multiplier", "0 = off"),
    _A("dry_base", "float32", "dry_base", ""),
    _A("dry_allowed_length", "int32", "dry_allowed_length", ""),
    _A("dry_last_n", "int32", "dry_penalty_last_n", "-1 = whole window, 0 = off"),
    _A("lz_penalty", "float32", "lz_penalty", "0 = off"),
    _A("top_n_sigma", "float32", "top_n_sigma", "<= 0 = off"),
    _A("typical_p", "float32", "typical_p", "1 = off"),
    _A("xtc_threshold", "float32", "xtc_threshold", ""),
    _A("xtc_probability", "float32", "xtc_probability", "0 = off"),
    _A("min_tokens", "int32", "min_tokens", "stop_ids are masked until this many"),
    _A("bias_ids", "int32", "logit_bias", "token ids (V = unused entry)", ("MAX_LOGIT_BIAS",),
       "V"),
    _A("bias_values", "float32", "logit_bias", "the biases", ("MAX_LOGIT_BIAS",), 0),
    _A("banned", "uint32", "banned_ids", "bitmask: always banned", ("W",), 0),
    _A("stop_ids", "uint32", "stop_ids", "bitmask: masked while fewer than min_tokens",
       ("W",), 0),
    _A("dry_breakers", "uint32", "dry_breaker_ids", "bitmask: DRY's sequence breakers",
       ("W",), 0),
    _A("bad_words", "int32", "bad_words", "sequences right-aligned (-1 before)",
       ("MAX_BAD_WORDS", "MAX_BAD_WORD_TOKENS"), -1),
    _A("bad_word_lens", "int32", "bad_words", "each sequence's length (0 = unused)",
       ("MAX_BAD_WORDS",), 0),
)
"""`SamplingState`'s arrays, in order."""


@dataclasses.dataclass(frozen=True)
class Spelling:
    """How one API names one field (or the CLI its flag).

    api: "openai" (chat and completions, with vLLM's, llama.cpp's and Metrale's extras),
    "responses", "anthropic" or "cli"; name: the JSON key (the CLI's flag); field: the
    `SamplingField`; json: the JSON type when not the field's; bound: the API's own bound
    when narrower (SAME: the field's); default: the API's default (SAME: unset = None, the
    field's default applies; REQUIRED: the API requires it); convert: the value as the field
    takes it; via: "" when the value goes to the field as it is, else the request model's
    property that carries it there; own: the request model declares the JSON field itself
    (its shape is the API's own, not one value of the field); items: the bound of each item
    of a list; constraints: more pydantic constraints."""

    api: str
    name: str
    field: str
    json: Any = None
    bound: Any = SAME
    default: Any = SAME
    convert: Callable[[Any], Any] | None = None
    via: str = ""
    own: bool = False
    items: Bound | None = None
    constraints: Mapping[str, Any] = dataclasses.field(default_factory=dict)


def _openai(*names: str) -> tuple[Spelling, ...]:
    return tuple(Spelling("openai", n, n) for n in names)


SPELLINGS: tuple[Spelling, ...] = (
    Spelling("openai", "max_tokens", "max_tokens", via="max_new_tokens"),
    Spelling("openai", "temperature", "temperature", bound=Bound(0, 2)),
    Spelling("openai", "top_k", "top_k", bound=Bound(-1), convert=lambda v: max(0, v)),
    *_openai("top_p", "min_p", "seed"),
    Spelling("openai", "stop", "stop", json=str | list[str]),
    Spelling("openai", "stop_token_ids", "stop_token_ids", json=list[int], items=Bound(0)),
    Spelling("openai", "ignore_eos", "ignore_eos", default=False),
    Spelling("openai", "skip_special_tokens", "skip_special_tokens", default=True),
    Spelling("openai", "include_stop_str_in_output", "include_stop_str_in_output",
             default=False),
    *_openai("repetition_penalty", "presence_penalty", "frequency_penalty"),
    Spelling("openai", "logit_bias", "logit_bias", json=dict[str, float]),
    *_openai("dry_multiplier", "dry_base", "dry_allowed_length", "dry_penalty_last_n"),
    Spelling("openai", "dry_sequence_breakers", "dry_sequence_breakers", json=list[str]),
    *_openai("lz_penalty", "top_n_sigma", "typical_p", "xtc_threshold", "xtc_probability"),
    Spelling("openai", "min_tokens", "min_tokens", default=0),
    Spelling("openai", "bad_words", "bad_words", json=list[str]),
    Spelling("openai", "repetition_detection", "repetition_detection",
             json=bool | dict[str, Any], constraints={"strict": True}),
    Spelling("openai", "num_beams", "num_beams", via="beams"),
    Spelling("openai", "length_penalty", "length_penalty",
             constraints={"allow_inf_nan": False}),
    Spelling("openai", "early_stopping", "early_stopping", json=bool | Literal["never"]),
    # Fields the request models carry in their own shapes (the property named by `via`):
    # logprobs (chat's logprobs + top_logprobs; completions' logprobs), constraint
    # (response_format, regex, choice, grammar), thinking_budget (chat's), lora (llama.cpp's
    # [{id, scale}] or the model name), speculative_tokens ({"speculative": {"num_tokens"}}),
    # num_return_sequences (n with beam search).
    Spelling("openai", "logprobs", "logprobs", via="num_logprobs", own=True),
    Spelling("openai", "response_format", "constraint", via="constraint", own=True),
    Spelling("openai", "thinking_budget", "thinking_budget", via="thinking_budget",
             own=True),
    Spelling("openai", "lora", "lora", via="lora", own=True),
    Spelling("openai", "speculative", "speculative_tokens", via="speculative", own=True),
    Spelling("openai", "n", "num_return_sequences", via="n", own=True),
    Spelling("responses", "max_output_tokens", "max_tokens"),
    Spelling("responses", "temperature", "temperature", bound=Bound(0, 2)),
    Spelling("responses", "top_p", "top_p"),
    Spelling("anthropic", "max_tokens", "max_tokens", default=REQUIRED),
    Spelling("anthropic", "stop_sequences", "stop", json=list[str]),
    Spelling("anthropic", "temperature", "temperature", bound=Bound(0, 1)),
    Spelling("anthropic", "top_p", "top_p"),
    Spelling("anthropic", "top_k", "top_k"),
    Spelling("anthropic", "seed", "seed"),
    Spelling("anthropic", "ignore_eos", "ignore_eos", json=bool),
    Spelling("cli", "--temperature", "temperature", default=0.0),  # generate: greedy
    *(Spelling("cli", "--" + n.replace("_", "-"), n) for n in (
        "top_k", "top_p", "min_p", "typical_p", "top_n_sigma", "xtc_threshold",
        "xtc_probability", "repetition_penalty", "presence_penalty", "frequency_penalty",
        "dry_multiplier", "dry_base", "dry_allowed_length", "dry_penalty_last_n",
        "lz_penalty", "min_tokens", "seed", "num_beams", "length_penalty")),
)
"""Every API's names for the fields (the CLI's list-valued flags live in serving/cli)."""

APIS = ("openai", "responses", "anthropic", "cli")


def spellings(api: str) -> tuple[Spelling, ...]:
    """The spellings of one API, in the table's order."""
    if api not in APIS:
        raise KeyError(f"unknown API {api!r} (one of {APIS})")
    return tuple(s for s in SPELLINGS if s.api == api)


def api_bound(spelling: Spelling) -> Bound | None:
    """The bound an API checks for a spelling: its own, else the field's."""
    return FIELD[spelling.field].bound if spelling.bound is SAME else spelling.bound


def api_default(spelling: Spelling) -> Any:
    """A spelling's default: its own, else None (unset: the field's default applies)."""
    return None if spelling.default is SAME else spelling.default


def openai_names(api: str) -> dict[str, str]:
    """{OpenAI name: this API's name} of every field the API spells (the chat request an
    API's request becomes takes them under their OpenAI names)."""
    openai = {s.field: s.name for s in spellings("openai")}
    return {openai[s.field]: s.name for s in spellings(api)}


def field_docs(names: tuple[str, ...] | None = None) -> str:
    """A docstring's list of fields (name: type = default: what it does; its bound)."""
    lines = []
    for f in FIELDS if names is None else tuple(FIELD[n] for n in names):
        kind = f.type.__name__ if isinstance(f.type, type) else str(f.type)
        kind = kind.replace("typing.", "").replace("collections.abc.", "")
        rule = f"; {f.bound.text()}" if f.bound is not None else ""
        lines.append(f"    {f.name}: {kind} = {f.default!r}: {f.doc}{rule}.")
    return "\n".join(lines)
