"""Grammar-constrained decoding, host side: constraints, their compiler and per-request matchers.

A request carries at most one `Constraint` (OpenAI's `response_format`, or the extension
fields `regex`, `choice`, `grammar`). `ConstraintCompiler` (one per model: it builds the
llguidance tokenizer once, ~0.3 s for a 49k vocabulary) validates a constraint before the
request is queued and hands each admitted request a `Matcher`. Every decode step, the
scheduler fills the allowed-token bitmask rows of the constrained slots (`Matcher.fill_many`,
in parallel on llguidance's thread pool), the engine applies the mask before sampling, and the
sampled token goes back into the matcher (`Matcher.consume`).

Bitmask layout: `[B, W]` with `W = ceil(V / 32)` words of 32 bits, bit `v % 32` of word
`v // 32` set = token `v` allowed; the layout of `metrale_jax.engine.bitmask`. llguidance
writes int32 words; the engine reads uint32: the same bytes, so `mask.view(np.uint32)` (no copy)
turns one into the other, and `fill` / `fill_many` accept either dtype. `V` is the engine's
vocabulary (the logits width): ids past the tokenizer's vocabulary are always 0. An eos id is
allowed exactly when the grammar accepts; once the grammar is complete (`is_stopped`), only eos
is allowed.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, get_args

import llguidance
import numpy as np
from llguidance.gbnf_to_lark import is_lark_syntax

from metrale_jax.errors import InvalidParameterError
from metrale_jax.scheduler.constraints_tokenizer import build_ll_tokenizer
from metrale_jax.text.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

ConstraintKind = Literal["json_object", "json_schema", "regex", "choice", "grammar", "gbnf"]
KINDS: tuple[str, ...] = get_args(ConstraintKind)

JsonWhitespace = Literal["bounded", "compact", "flexible"]
BOUNDED_WHITESPACE = r"(?: |\n{1,2}[ \t]{0,20})?"
"""Whitespace between JSON tokens in "bounded" mode: nothing, one space, or one or two newlines
and up to 20 spaces or tabs (llama.cpp's `space` rule). llguidance's default ("flexible")
allows any run, on which small models (and random walks) produce page after page of newlines."""

_PARAMS = {"json_object": "response_format", "json_schema": "response_format", "gbnf": "grammar"}
_WHAT = {
    "json_object": "JSON object",
    "json_schema": "JSON schema",
    "regex": "regex",
    "choice": "choice",
    "grammar": "Lark grammar",
    "gbnf": "GBNF grammar",
}
_GBNF_RULE = re.compile(r"(?m)^\s*[A-Za-z][\w-]*\s*::=")
_MAX_MESSAGE = 2000
_REGEX_WRAPPER = re.compile(r"(?ms)^\s*\d+ \| start: /.*\Z")


@dataclass(frozen=True)
class Constraint:
    """What one request's output must match.

    Attributes:
        kind: "json_object" (any JSON object), "json_schema", "regex" (the whole output is one
            match, Rust `regex` syntax), "choice" (exactly one of the strings), "grammar" (Lark,
            as llguidance reads it) or "gbnf" (llama.cpp's GBNF, converted to Lark).
        value: json_schema: the schema as JSON text (its key order kept: llguidance generates
            properties in schema order); choice: the strings; otherwise the pattern or grammar
            text; json_object: "".
        name: json_schema's `name`, for logs.
        strict: json_schema's `strict` flag (kept for the record: the schema is always
            enforced).
    """

    kind: ConstraintKind
    value: str | tuple[str, ...] = ""
    name: str | None = None
    strict: bool | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise InvalidParameterError(f"unknown constraint kind {self.kind!r}; one of {KINDS}")
        if self.kind == "choice":
            value = self.value
            if (
                not isinstance(value, tuple)
                or not value
                or not all(isinstance(v, str) for v in value)
            ):
                raise InvalidParameterError(
                    "choice must be a non-empty list of strings", param="choice"
                )
        elif not isinstance(self.value, str):
            raise InvalidParameterError(f"{self.param} must be a string", param=self.param)

    @property
    def param(self) -> str:
        """The request parameter this constraint comes from (for error messages)."""
        return _PARAMS.get(self.kind, self.kind)

    @property
    def schema(self) -> dict | None:
        """The JSON schema of a json_schema constraint, or None."""
        return json.loads(self.value) if self.kind == "json_schema" else None  # type: ignore[arg-type]

    @classmethod
    def from_schema(
        cls, schema: Mapping[str, Any], *, name: str | None = None, strict: bool | None = None
    ) -> Constraint:
        """A json_schema constraint from a schema object."""
        if not isinstance(schema, Mapping):
            raise InvalidParameterError(
                "response_format.json_schema.schema must be a JSON object",
                param="response_format",
            )
        try:
            text = json.dumps(schema, ensure_ascii=False, allow_nan=False)
        except (TypeError, ValueError) as err:
            raise InvalidParameterError(
                f"response_format.json_schema.schema is not JSON: {err}", param="response_format"
            ) from err
        return cls("json_schema", text, name=name, strict=strict)

    @classmethod
    def from_request(
        cls,
        *,
        response_format: Mapping[str, Any] | None = None,
        regex: str | None = None,
        choice: Sequence[str] | None = None,
        grammar: str | None = None,
        grammar_syntax: Literal["lark", "gbnf"] | None = None,
    ) -> Constraint | None:
        """The one constraint of a request's fields, or None when it has none.

        Args:
            response_format: OpenAI's `{"type": "text" | "json_object" | "json_schema",
                "json_schema": {"name", "schema", "strict"}}`; "text" is no constraint, and a
                json_schema without `schema` is any JSON object.
            regex: the whole output must match it.
            choice: the output is exactly one of these strings.
            grammar: a Lark grammar as llguidance reads it, or llama.cpp GBNF; which one is
                `grammar_syntax`, or detected (a `start:` rule or `%llguidance` is Lark; else
                `name ::=` rules are GBNF).
            grammar_syntax: "lark" or "gbnf" to skip the detection.

        Raises:
            InvalidParameterError: a field has the wrong shape, or more than one is set (the
                error names the second).
        """
        found: list[tuple[str, Constraint]] = []
        if response_format is not None:
            constraint = _from_response_format(response_format)
            if constraint is not None:
                found.append(("response_format", constraint))
        if regex is not None:
            if not isinstance(regex, str):
                raise InvalidParameterError("regex must be a string", param="regex")
            found.append(("regex", cls("regex", regex)))
        if choice is not None:
            if isinstance(choice, str | bytes) or not isinstance(choice, Sequence):
                raise InvalidParameterError(
                    "choice must be a non-empty list of strings", param="choice"
                )
            found.append(("choice", cls("choice", tuple(choice))))
        if grammar is not None:
            if not isinstance(grammar, str):
                raise InvalidParameterError("grammar must be a string", param="grammar")
            found.append(("grammar", cls(_grammar_kind(grammar, grammar_syntax), grammar)))
        if len(found) > 1:
            names = ", ".join(name for name, _ in found)
            raise InvalidParameterError(
                f"only one of response_format (json_object/json_schema), regex, choice and "
                f"grammar may be set in one request; got {names}",
                param=found[1][0],
            )
        return found[0][1] if found else None


def _from_response_format(response_format: Mapping[str, Any]) -> Constraint | None:
    if not isinstance(response_format, Mapping):
        raise InvalidParameterError("response_format must be an object", param="response_format")
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint("json_object")
    if kind != "json_schema":
        raise InvalidParameterError(
            f"response_format.type must be 'text', 'json_object' or 'json_schema', not {kind!r}",
            param="response_format",
        )
    spec = response_format.get("json_schema")
    if not isinstance(spec, Mapping):
        raise InvalidParameterError(
            "response_format.json_schema must be an object with a 'schema'",
            param="response_format",
        )
    name, strict = spec.get("name"), spec.get("strict")
    if name is not None and not isinstance(name, str):
        raise InvalidParameterError(
            "response_format.json_schema.name must be a string", param="response_format"
        )
    if strict is not None and not isinstance(strict, bool):
        raise InvalidParameterError(
            "response_format.json_schema.strict must be a boolean", param="response_format"
        )
    if spec.get("schema") is None:
        return Constraint("json_object", name=name, strict=strict)
    return Constraint.from_schema(spec["schema"], name=name, strict=strict)


def _grammar_kind(text: str, syntax: str | None) -> ConstraintKind:
    if syntax is not None:
        if syntax not in ("lark", "gbnf"):
            raise InvalidParameterError(
                f"grammar syntax must be 'lark' or 'gbnf', not {syntax!r}", param="grammar"
            )
        return "grammar" if syntax == "lark" else "gbnf"
    if is_lark_syntax(text):
        return "grammar"
    return "gbnf" if _GBNF_RULE.search(text) else "grammar"


class ConstraintViolationError(RuntimeError):
    """A matcher was given a token its grammar does not allow (the mask was not applied, or a
    token was forced past it). The matcher stays in its error state; the scheduler should end
    the request with an error. Not the user's fault: a server error."""


def _check_words(array: np.ndarray, words: int, what: str) -> None:
    if array.dtype.kind not in "iu" or array.dtype.itemsize != 4:
        raise TypeError(f"{what} must be int32 or uint32, not {array.dtype}")
    if array.shape[-1] != words:
        raise ValueError(
            f"{what} has {array.shape[-1]} words per row; this vocabulary needs {words}"
        )
    if not array.flags["C_CONTIGUOUS"] or not array.flags["WRITEABLE"]:
        raise ValueError(f"{what} must be C-contiguous and writeable")


@dataclass(frozen=True)
class _Padding:
    """The words that hold ids past the tokenizer's vocabulary, and which of their bits stay."""

    first_word: int
    keep: np.ndarray  # [W - first_word] int32


class Matcher:
    """One request's grammar state: which tokens may come next, fed each sampled token.

    Not thread-safe: one thread (the batching loop) drives it. Made by
    `ConstraintCompiler.matcher`.
    """

    _executor: ClassVar[llguidance.LLExecutor | None] = None
    _executor_lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(
        self, inner: llguidance.LLMatcher, constraint: Constraint, words: int, padding: _Padding
    ) -> None:
        self._inner = inner
        self.constraint = constraint
        self.words = words
        self._padding = padding
        self._error: str | None = None

    def __repr__(self) -> str:
        state = "error" if self._error else "stopped" if self.is_stopped() else "running"
        return f"Matcher({self.constraint.kind}, {state})"

    @property
    def error(self) -> str | None:
        """Why the matcher is in its error state (a rejected token), or None."""
        return self._error

    @property
    def stop_reason(self) -> str:
        """llguidance's stop reason: "NotStopped", "NoExtension" (grammar complete),
        "EndOfSentence" (eos consumed), or a limit/error reason."""
        return self._inner.stop_reason()

    def is_accepting(self) -> bool:
        """Whether the output so far is a complete match (eos is allowed now)."""
        return self._inner.is_accepting()

    def is_stopped(self) -> bool:
        """Whether nothing but eos may follow (the grammar is complete, eos was consumed, or
        the matcher is in its error state): the request can finish now."""
        return self._inner.is_stopped()

    def consume(self, token_id: int) -> None:
        """Advance past the sampled `token_id`.

        Raises:
            ConstraintViolationError: the grammar does not allow it (then `error` says why).
        """
        if not self._inner.consume_token(int(token_id)):
            self._flag(int(token_id))
            raise ConstraintViolationError(self._error)

    def _flag(self, token_id: int) -> None:
        detail = self._inner.get_error().strip().split("\n", 1)[0]
        kind = self.constraint.kind
        self._error = f"token {token_id} rejected by the {kind} constraint: {detail}"
        logger.warning("%s", self._error)

    def fill(self, row: np.ndarray) -> None:
        """Write the allowed next tokens into `row: [W] int32 | uint32` (C-contiguous)."""
        _check_words(row, self.words, "bitmask row")
        if row.ndim != 1:
            raise ValueError(f"bitmask row must be 1-D, not of shape {row.shape}")
        self._inner.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
        pad = self._padding
        if pad.keep.size:
            row.view(np.int32)[pad.first_word :] &= pad.keep

    @classmethod
    def _pool(cls) -> llguidance.LLExecutor:
        with cls._executor_lock:
            if cls._executor is None:
                cls._executor = llguidance.LLExecutor()
            return cls._executor

    @staticmethod
    def fill_many(pairs: Sequence[tuple[Matcher, int]], bitmask: np.ndarray) -> None:
        """Fill row `r` of `bitmask: [B, W] int32 | uint32` for each `(matcher, r)` in parallel
        (llguidance's thread pool, the GIL released). Other rows are left as they are.

        Raises:
            ValueError: a row is out of range or named twice, or the matchers' vocabularies
                differ from the bitmask's width.
        """
        if not pairs:
            return
        if bitmask.ndim != 2:
            raise ValueError(f"bitmask must be [B, W], not of shape {bitmask.shape}")
        words = pairs[0][0].words
        _check_words(bitmask, words, "bitmask")
        rows = [int(r) for _, r in pairs]
        if len(set(rows)) != len(rows) or min(rows) < 0 or max(rows) >= bitmask.shape[0]:
            raise ValueError(f"rows {rows} must be distinct and in [0, {bitmask.shape[0]})")
        if any(m.words != words for m, _ in pairs):
            raise ValueError("matchers of different vocabularies in one bitmask")
        Matcher._pool().unsafe_compute_mask_ptr(
            [(m._inner, r) for m, r in pairs], bitmask.ctypes.data, words * 4, bitmask.shape[0]
        )
        pad = pairs[0][0]._padding
        if pad.keep.size:
            bitmask.view(np.int32)[rows, pad.first_word :] &= pad.keep

    @staticmethod
    def consume_many(pairs: Sequence[tuple[Matcher, int]]) -> list[Matcher]:
        """Advance each `(matcher, token_id)` in parallel; returns the matchers that rejected
        their token (each now in its error state, `error` set). Never raises for a rejection."""
        if not pairs:
            return []
        ok = Matcher._pool().consume_token_par([(m._inner, int(t)) for m, t in pairs])
        rejected = []
        for (matcher, token_id), good in zip(pairs, ok, strict=True):
            if not good:
                matcher._flag(int(token_id))
                rejected.append(matcher)
        return rejected


class ConstraintCompiler:
    """Validates constraints and makes matchers for one model's tokenizer.

    Args:
        tokenizer: the model's tokenizer (any `metrale_jax.text` backend).
        vocab_size: the engine's vocabulary `V` (logits width, >= the tokenizer's); default the
            tokenizer's.
        json_whitespace: whitespace between JSON tokens for json_object / json_schema:
            "bounded" (see `BOUNDED_WHITESPACE`), "compact" (none: `{"a":1,"b":2}`) or
            "flexible" (any, llguidance's default). A schema's own top-level `x-guidance`
            options override it.
        cache_size: how many compiled constraints to keep (a matcher of a cached one is a
            cheap copy).
        limits: llguidance's parser limits (default: its own).
        from_bytes: build the llguidance tokenizer from token bytes (see
            `constraints_tokenizer.build_ll_tokenizer`).

    Thread-safe: `validate` runs on the HTTP side, `matcher` in the batching loop.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        vocab_size: int | None = None,
        *,
        json_whitespace: JsonWhitespace = "bounded",
        cache_size: int = 128,
        limits: llguidance.LLParserLimits | None = None,
        from_bytes: bool = False,
    ) -> None:
        if json_whitespace not in get_args(JsonWhitespace):
            raise ValueError(f"json_whitespace must be one of {get_args(JsonWhitespace)}")
        self.tokenizer = tokenizer
        self.ll_tokenizer = build_ll_tokenizer(tokenizer, vocab_size, from_bytes=from_bytes)
        self.vocab_size = self.ll_tokenizer.vocab_size
        self.words = (self.vocab_size + 31) // 32
        self.eos_token_ids: tuple[int, ...] = tuple(self.ll_tokenizer.eos_tokens)
        self._json_options: dict[str, Any] = {
            "bounded": {"whitespace_flexible": True, "whitespace_pattern": BOUNDED_WHITESPACE},
            "compact": {"whitespace_flexible": False},
            "flexible": {"whitespace_flexible": True},
        }[json_whitespace]
        self._limits = limits
        self._cache_size = int(cache_size)
        self._cache: OrderedDict[Constraint, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()
        self._padding = self._padding_of(tokenizer.vocab_size)

    def _padding_of(self, tokenizer_vocab: int) -> _Padding:
        first = tokenizer_vocab // 32
        if tokenizer_vocab >= self.vocab_size:
            return _Padding(self.words, np.zeros(0, np.int32))
        ids = np.arange(first * 32, self.words * 32)
        keep = (ids < tokenizer_vocab).reshape(-1, 32)
        packed = (keep.astype(np.uint64) << np.arange(32, dtype=np.uint64)).sum(axis=1)
        return _Padding(first, packed.astype(np.uint32).view(np.int32))

    def allocate(self, batch: int) -> np.ndarray:
        """A `[batch, W] int32` bitmask with every token allowed (an unconstrained row)."""
        return np.full((batch, self.words), -1, np.int32)

    def grammar(self, constraint: Constraint) -> str:
        """The llguidance grammar text of `constraint` (not yet checked against llguidance).

        Raises:
            InvalidParameterError: a GBNF grammar that cannot be converted to Lark, or a schema
                llguidance cannot read.
        """
        kind, value = constraint.kind, constraint.value
        try:
            if kind == "json_object":
                return llguidance.LLMatcher.grammar_from_json_schema(
                    '{"type": "object"}', defaults=self._json_options  # type: ignore[arg-type]
                )
            if kind == "json_schema":
                return llguidance.LLMatcher.grammar_from_json_schema(
                    value, defaults=self._json_options  # type: ignore[arg-type]
                )
            if kind == "choice":
                return llguidance.grammar_from("choice", json.dumps(list(value)))
            if kind == "gbnf":
                return llguidance.grammar_from("gbnf", value)  # type: ignore[arg-type]
            return llguidance.grammar_from("lark" if kind == "grammar" else "regex", value)  # type: ignore[arg-type]
        except ValueError as err:
            raise self._invalid(constraint, str(err)) from err

    @staticmethod
    def _invalid(constraint: Constraint, message: str) -> InvalidParameterError:
        if constraint.kind == "regex":  # drop the Lark wrapper llguidance puts around a regex
            message = _REGEX_WRAPPER.sub("", message).removeprefix("at 1(8): ")
        message = message.strip() or "rejected by llguidance"
        if len(message) > _MAX_MESSAGE:
            message = message[:_MAX_MESSAGE] + " ..."
        return InvalidParameterError(
            f"invalid {_WHAT[constraint.kind]}: {message}", param=constraint.param
        )

    def _template(self, constraint: Constraint) -> llguidance.LLMatcher:
        with self._lock:
            template = self._cache.get(constraint)
            if template is not None:
                self._cache.move_to_end(constraint)
                return template
        grammar = self.grammar(constraint)
        template = llguidance.LLMatcher(
            self.ll_tokenizer, grammar, log_level=0, limits=self._limits
        )
        if template.is_error():
            raise self._invalid(constraint, template.get_error())
        for warning in template.get_grammar_warnings():
            logger.info("%s constraint: %s", constraint.kind, warning)
        with self._lock:
            self._cache[constraint] = template
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return template

    def validate(self, constraint: Constraint) -> None:
        """Check (and compile, for `matcher` later) `constraint`; call before queueing.

        Raises:
            InvalidParameterError: an invalid schema, regex or grammar, with llguidance's
                message and the request parameter it came from.
        """
        self._template(constraint)

    def matcher(self, constraint: Constraint) -> Matcher:
        """A fresh `Matcher` for one request (validating `constraint` if not done yet).

        Raises:
            InvalidParameterError: as `validate`.
        """
        template = self._template(constraint)
        with self._lock:
            inner = template.deep_copy()
        return Matcher(inner, constraint, self.words, self._padding)
