"""Constraints, their compiler and matchers (llguidance), without a model.

The walks stand in for a random-weight model: at every step they draw a token uniformly from
the mask's allowed tokens, and the output must still parse and validate, on every seed, on the
tiny HF tokenizer (with the engine's vocabulary padded past it), the default model's GGUF
tokenizer and a SentencePiece tokenizer. Schemas and patterns are bounded (maxLength, maxItems,
{m,n}) so that uniform walks end in a few dozen tokens.
"""

from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest

from metrale_jax.engine.bitmask import unpack_np
from metrale_jax.errors import InvalidParameterError
from metrale_jax.scheduler.constraints import (
    Constraint,
    ConstraintCompiler,
    ConstraintViolationError,
    Matcher,
)
from metrale_jax.text.loader import load_tokenizer
from metrale_jax.text.tokenizer import Tokenizer

SEEDS = range(20)
PAD = 45  # the tiny HF model's engine vocabulary is padded past the tokenizer's by this much

SCHEMAS = {
    "nested": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "minLength": 1, "maxLength": 12},
                    "id": {"type": "integer", "minimum": 1, "maximum": 9999},
                },
                "required": ["name", "id"],
                "additionalProperties": False,
            },
            "active": {"type": "boolean"},
        },
        "required": ["user", "active"],
        "additionalProperties": False,
    },
    "arrays": {
        "type": "object",
        "properties": {
            "scores": {
                "type": "array",
                "items": {"type": "number", "minimum": 0, "maximum": 1},
                "minItems": 1,
                "maxItems": 4,
            },
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 3},
        },
        "required": ["scores"],
        "additionalProperties": False,
    },
    "enums_and_bounds": {
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "size": {"type": "integer", "minimum": -5, "maximum": 5},
            "ratio": {"type": "number", "exclusiveMinimum": 0, "maximum": 10},
            "label": {"type": ["string", "null"], "maxLength": 6},
        },
        "required": ["color", "size", "ratio"],
        "additionalProperties": False,
    },
    "array_of_objects": {
        "type": "array",
        "items": {
            "type": "object",
            "properties": {"k": {"const": "v"}, "n": {"type": "integer", "minimum": 0}},
            "required": ["k"],
            "additionalProperties": False,
        },
        "maxItems": 3,
    },
    "refs_and_any_of": {
        "$defs": {
            "point": {
                "type": "object",
                "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
                "required": ["x", "y"],
                "additionalProperties": False,
            }
        },
        "type": "object",
        "properties": {
            "a": {"$ref": "#/$defs/point"},
            "b": {"anyOf": [{"type": "integer", "maximum": 9}, {"type": "string", "maxLength": 3}]},
        },
        "required": ["a"],
        "additionalProperties": False,
    },
}

REGEXES = [
    r"[0-9]{3}-[0-9]{4}",
    r"(yes|no|maybe)",
    r"[a-z]{1,8}@[a-z]{2,6}\.(com|org)",
    r"-?(0|[1-9][0-9]{0,5})(\.[0-9]{1,3})?",
    r"#[0-9a-fA-F]{6}",
    r"\d{2,4}",  # Unicode digits in both llguidance (Rust regex) and Python's re
]

CHOICES = [
    ("yes", "no", "maybe"),
    ("café", "数字", 'a"b\\c', "new\nline"),
    ("a", "ab", "abc"),  # "a" is complete and may go on: eos competes with "b"
]

LARK = 'start: "(" NUM OP NUM ")"\nOP: "+" | "-" | "*"\nNUM: /[0-9]{1,3}/\n'
GBNF = 'root ::= "(" num op num ")"\nnum ::= [0-9]{1,3}\nop ::= "+" | "-" | "*"\n'
EXPRESSION = r"\([0-9]{1,3}[-+*][0-9]{1,3}\)"


# ---- fixtures ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_tokenizer(tmp_path_factory) -> Tokenizer:
    from devtools.hf_models import save_tiny_tokenizer

    folder = tmp_path_factory.mktemp("tiny-tokenizer")
    save_tiny_tokenizer(folder)
    return load_tokenizer(folder)


@pytest.fixture(scope="module")
def gguf_tokenizer(default_gguf) -> Tokenizer:
    return load_tokenizer(default_gguf)


@pytest.fixture(scope="module")
def spm_tokenizer(tmp_path_factory) -> Tokenizer:
    from metrale_jax.text.sentencepiece_tokenizer import SentencePieceTokenizer
    from tests.text.builders import train_sentencepiece

    model = train_sentencepiece(tmp_path_factory.mktemp("spm"))
    return SentencePieceTokenizer(model.read_bytes(), name=str(model))


@pytest.fixture(scope="module")
def llama_style_tokenizer(tmp_path_factory) -> Tokenizer:
    """A Llama-2-style tokenizer.json (`▁` spaces, byte fallback, a leading space dropped)."""
    from tests.text.builders import build_llama_style_folder

    return load_tokenizer(build_llama_style_folder(tmp_path_factory.mktemp("llama-style")))


@pytest.fixture(scope="module")
def two_eos_tokenizer(tmp_path_factory) -> Tokenizer:
    """A byte-level BPE whose generation config names two eos ids."""
    from tests.text.builders import build_byte_level_folder

    tokenizer = load_tokenizer(build_byte_level_folder(tmp_path_factory.mktemp("two-eos")))
    assert len(tokenizer.eos_token_ids) == 2
    return tokenizer


@pytest.fixture(scope="module")
def hf_compiler(hf_tokenizer) -> ConstraintCompiler:
    return ConstraintCompiler(hf_tokenizer, hf_tokenizer.vocab_size + PAD)


@pytest.fixture(scope="module")
def gguf_compiler(gguf_tokenizer) -> ConstraintCompiler:
    return ConstraintCompiler(gguf_tokenizer)


@pytest.fixture(scope="module", params=["hf", "gguf"])
def compiler(request) -> ConstraintCompiler:
    return request.getfixturevalue(f"{request.param}_compiler")


# ---- the random walk --------------------------------------------------------------------


def allowed_ids(compiler: ConstraintCompiler, row: np.ndarray) -> np.ndarray:
    return np.flatnonzero(unpack_np(row.view(np.uint32), compiler.vocab_size))


def walk(
    compiler: ConstraintCompiler, constraint: Constraint, seed: int, max_tokens: int = 400
) -> str:
    """Draw uniformly from the allowed tokens until eos; the text before eos.

    Checks on every step: eos is allowed exactly when the matcher accepts, and no id past the
    tokenizer's vocabulary is ever allowed.
    """
    rng = np.random.default_rng(seed)
    matcher = compiler.matcher(constraint)
    mask = compiler.allocate(1)
    eos = set(compiler.eos_token_ids)
    tokenizer = compiler.tokenizer
    ids: list[int] = []
    for _ in range(max_tokens):
        matcher.fill(mask[0])
        allowed = allowed_ids(compiler, mask[0])
        assert allowed.size and allowed.max() < tokenizer.vocab_size
        allowed_eos = eos.intersection(allowed.tolist())
        assert allowed_eos == (eos if matcher.is_accepting() else set())
        token = int(rng.choice(allowed))
        matcher.consume(token)
        if token in eos:
            assert matcher.is_stopped()
            return tokenizer.decode(ids)
        ids.append(token)
    raise AssertionError(f"no eos after {max_tokens} tokens: {tokenizer.decode(ids)!r}")


# ---- walks: output parses and validates on every seed --------------------------------------


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_json_schema_walks_validate(compiler, name):
    schema = SCHEMAS[name]
    constraint = Constraint.from_request(
        response_format={"type": "json_schema", "json_schema": {"name": name, "schema": schema}}
    )
    compiler.validate(constraint)
    for seed in SEEDS:
        text = walk(compiler, constraint, seed)
        jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize("pattern", REGEXES)
def test_regex_walks_fullmatch(compiler, pattern):
    constraint = Constraint.from_request(regex=pattern)
    for seed in SEEDS:
        text = walk(compiler, constraint, seed)
        assert re.fullmatch(pattern, text), (pattern, text)


@pytest.mark.parametrize("options", CHOICES, ids=["words", "escapes", "prefixes"])
def test_choice_walks_pick_one(compiler, options):
    constraint = Constraint.from_request(choice=list(options))
    seen = {walk(compiler, constraint, seed) for seed in SEEDS}
    assert seen <= set(options)
    assert len(seen) > 1  # uniform draws do not always take the same branch


@pytest.mark.parametrize("text", [LARK, GBNF], ids=["lark", "gbnf"])
def test_grammar_walks_match(compiler, text):
    constraint = Constraint.from_request(grammar=text)
    assert constraint.kind == ("grammar" if text is LARK else "gbnf")
    for seed in SEEDS:
        assert re.fullmatch(EXPRESSION, walk(compiler, constraint, seed))


def test_json_object_allows_objects_only(compiler):
    constraint = Constraint.from_request(response_format={"type": "json_object"})
    tokenizer = compiler.tokenizer
    mask = compiler.allocate(1)
    matcher = compiler.matcher(constraint)
    matcher.fill(mask[0])
    firsts = [tokenizer.decode([int(i)]) for i in allowed_ids(compiler, mask[0])]
    assert firsts and all(text.startswith("{") for text in firsts)
    for token in tokenizer.encode('{"a": [1, {"b": null}], "c": "d"}', add_special_tokens=False):
        matcher.consume(token)
    assert matcher.is_accepting()
    with pytest.raises(ConstraintViolationError):
        compiler.matcher(constraint).consume(tokenizer.encode("[", add_special_tokens=False)[0])


@pytest.mark.parametrize("which", ["spm", "llama_style", "two_eos"])
@pytest.mark.parametrize("from_bytes", [False, True], ids=["auto", "bytes"])
def test_other_tokenizers_walk(request, which, from_bytes):
    """SentencePiece (always from token bytes), `▁`-style and two-eos tokenizer.json files."""
    tokenizer = request.getfixturevalue(f"{which}_tokenizer")
    compiler = ConstraintCompiler(tokenizer, tokenizer.vocab_size + 24, from_bytes=from_bytes)
    schema = SCHEMAS["enums_and_bounds"]
    for seed in range(8):
        text = walk(compiler, Constraint.from_schema(schema), seed)
        jsonschema.validate(json.loads(text), schema)
        text = walk(compiler, Constraint("regex", REGEXES[2]), seed)
        assert re.fullmatch(REGEXES[2], text)


@pytest.mark.parametrize("which", ["hf", "gguf", "llama_style", "two_eos"])
def test_token_bytes_path_gives_the_same_masks(request, which):
    """The fallback (token bytes + our encoder) sees the vocabulary as tokenizer.json does."""
    tokenizer = request.getfixturevalue(f"{which}_tokenizer")
    V = tokenizer.vocab_size + PAD
    by_json = ConstraintCompiler(tokenizer, V)
    by_bytes = ConstraintCompiler(tokenizer, V, from_bytes=True)
    schema = {"type": "object", "properties": {"s": {"type": "string", "maxLength": 30}}}
    for constraint in (Constraint.from_schema(schema), Constraint("grammar", LARK)):
        rng = np.random.default_rng(0)
        a, b = by_json.matcher(constraint), by_bytes.matcher(constraint)
        mask_a, mask_b = by_json.allocate(1), by_bytes.allocate(1)
        for _ in range(30):
            a.fill(mask_a[0])
            b.fill(mask_b[0])
            np.testing.assert_array_equal(mask_a, mask_b)
            token = int(rng.choice(allowed_ids(by_json, mask_a[0])))
            if token in by_json.eos_token_ids:
                break
            a.consume(token)
            b.consume(token)


# ---- matcher states ----------------------------------------------------------------------


def test_complete_match_allows_only_eos(hf_compiler):
    tokenizer = hf_compiler.tokenizer
    matcher = hf_compiler.matcher(Constraint("choice", ("yes", "no")))
    for token in tokenizer.encode("yes", add_special_tokens=False):
        assert not matcher.is_stopped()
        matcher.consume(token)
    assert matcher.is_stopped() and matcher.is_accepting()
    mask = hf_compiler.allocate(1)
    matcher.fill(mask[0])
    assert allowed_ids(hf_compiler, mask[0]).tolist() == [tokenizer.eos_token_id]


def test_rejected_token_raises_and_flags(hf_compiler):
    tokenizer = hf_compiler.tokenizer
    matcher = hf_compiler.matcher(Constraint("regex", "[0-9]+"))
    letter = tokenizer.encode("x", add_special_tokens=False)[0]
    with pytest.raises(ConstraintViolationError, match=f"token {letter} rejected by the regex"):
        matcher.consume(letter)
    assert matcher.error and matcher.is_stopped()
    mask = hf_compiler.allocate(1)
    matcher.fill(mask[0])  # an errored matcher allows eos only: the request can end
    assert allowed_ids(hf_compiler, mask[0]).tolist() == [tokenizer.eos_token_id]


def test_padding_ids_are_never_allowed(hf_compiler):
    """Even a grammar naming a padding id by number gets a mask without it."""
    padding_id = hf_compiler.vocab_size - 1
    assert padding_id >= hf_compiler.tokenizer.vocab_size
    for text in (f"start: <[{padding_id}]>", 'start: /.{0,3}/'):
        mask = hf_compiler.allocate(2)
        matcher = hf_compiler.matcher(Constraint("grammar", text))
        matcher.fill(mask[0])
        Matcher.fill_many([(matcher, 1)], mask)
        np.testing.assert_array_equal(mask[0], mask[1])
        bits = unpack_np(mask.view(np.uint32), hf_compiler.words * 32)
        assert not bits[:, hf_compiler.tokenizer.vocab_size :].any()


def walked_matchers(compiler: ConstraintCompiler, n: int) -> list[Matcher]:
    """`n` matchers of different constraints, each a different number of tokens in."""
    constraints = [Constraint.from_schema(s) for s in SCHEMAS.values()]
    constraints += [Constraint("regex", r) for r in REGEXES] + [Constraint("grammar", LARK)]
    rng = np.random.default_rng(1)
    mask = compiler.allocate(1)
    matchers = []
    for i in range(n):
        matcher = compiler.matcher(constraints[i % len(constraints)])
        for _ in range(i % 7):
            matcher.fill(mask[0])
            token = int(rng.choice(allowed_ids(compiler, mask[0])))
            if token in compiler.eos_token_ids:
                break
            matcher.consume(token)
        matchers.append(matcher)
    return matchers


@pytest.mark.parametrize("dtype", [np.int32, np.uint32])
def test_fill_many_equals_fill(compiler, dtype):
    matchers = walked_matchers(compiler, 16)
    one_by_one = compiler.allocate(20).astype(dtype)
    for row, matcher in enumerate(matchers):
        matcher.fill(one_by_one[row])
    rows = np.random.default_rng(2).permutation(20)[:16]
    parallel = compiler.allocate(20).astype(dtype)
    Matcher.fill_many([(m, int(r)) for m, r in zip(matchers, rows, strict=True)], parallel)
    np.testing.assert_array_equal(parallel[rows], one_by_one[:16])
    untouched = np.setdiff1d(np.arange(20), rows)
    assert (parallel[untouched].view(np.int32) == -1).all()


def test_fill_many_rejects_bad_rows(hf_compiler):
    matchers = walked_matchers(hf_compiler, 2)
    mask = hf_compiler.allocate(2)
    with pytest.raises(ValueError, match="distinct"):
        Matcher.fill_many([(matchers[0], 1), (matchers[1], 1)], mask)
    with pytest.raises(ValueError, match="distinct"):
        Matcher.fill_many([(matchers[0], 2)], mask)
    with pytest.raises(ValueError, match="words per row"):
        Matcher.fill_many([(matchers[0], 0)], np.zeros((2, hf_compiler.words + 1), np.int32))
    with pytest.raises(TypeError):
        matchers[0].fill(np.zeros(hf_compiler.words, np.int64))


def test_consume_many_equals_consume(hf_compiler):
    constraint = Constraint("regex", "[0-9]{1,4}")
    tokenizer = hf_compiler.tokenizer
    digit, letter = (tokenizer.encode(t, add_special_tokens=False)[0] for t in ("7", "x"))
    good, bad = hf_compiler.matcher(constraint), hf_compiler.matcher(constraint)
    assert Matcher.consume_many([(good, digit), (bad, letter)]) == [bad]
    assert good.error is None and bad.error
    reference = hf_compiler.matcher(constraint)
    reference.consume(digit)
    a, b = hf_compiler.allocate(1), hf_compiler.allocate(1)
    good.fill(a[0])
    reference.fill(b[0])
    np.testing.assert_array_equal(a, b)


# ---- request fields and errors -------------------------------------------------------------


def test_from_request_mapping():
    assert Constraint.from_request() is None
    assert Constraint.from_request(response_format={"type": "text"}) is None
    assert Constraint.from_request(response_format={"type": "json_object"}).kind == "json_object"
    schema = {"type": "object", "properties": {"b": {}, "a": {}}}
    c = Constraint.from_request(
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "thing", "schema": schema, "strict": True},
        }
    )
    assert (c.kind, c.name, c.strict, c.schema) == ("json_schema", "thing", True, schema)
    assert list(c.schema["properties"]) == ["b", "a"]  # key order kept: it is the output's
    assert Constraint.from_request(choice=["x", "y"]) == Constraint("choice", ("x", "y"))
    assert Constraint.from_request(grammar=GBNF).kind == "gbnf"
    assert Constraint.from_request(grammar=LARK).kind == "grammar"
    assert Constraint.from_request(grammar='root ::= "a"', grammar_syntax="lark").kind == "grammar"
    assert hash(c) == hash(Constraint.from_schema(schema, name="thing", strict=True))


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        (dict(response_format={"type": "json_object"}, regex="a"), "regex",
         "response_format, regex"),
        (dict(regex="a", choice=["a"]), "choice", "regex, choice"),
        (dict(choice=["a"], grammar=LARK), "grammar", "choice, grammar"),
        (dict(response_format={"type": "xml"}), "response_format", "'xml'"),
        (dict(response_format={"type": "json_schema"}), "response_format", "json_schema"),
        (dict(response_format={"type": "json_schema", "json_schema": {"schema": [1]}}),
         "response_format", "JSON object"),
        (dict(choice=[]), "choice", "non-empty list"),
        (dict(choice="yes"), "choice", "list of strings"),
        (dict(choice=["a", 1]), "choice", "list of strings"),
        (dict(regex=3), "regex", "string"),
        (dict(grammar=LARK, grammar_syntax="ebnf"), "grammar", "'lark' or 'gbnf'"),
    ],
)
def test_from_request_errors(fields, param, words):
    with pytest.raises(InvalidParameterError) as info:
        Constraint.from_request(**fields)
    assert info.value.param == param
    assert words in info.value.message
    assert info.value.to_openai()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("constraint", "param", "words"),
    [
        (Constraint.from_schema({"type": "foo"}), "response_format", "Invalid type: foo"),
        (Constraint.from_schema({"type": "string", "format": "nope"}), "response_format",
         "Unknown format: nope"),
        (Constraint.from_schema({"properties": {"a": {"$ref": "#/x"}}}), "response_format",
         "'/x' does not exist"),
        (Constraint("regex", "a(b"), "regex", "unclosed group"),
        (Constraint("regex", "(?<=a)b"), "regex", "look-around"),
        (Constraint("grammar", "start: foo"), "grammar", 'unknown name: "foo"'),
        (Constraint("gbnf", "root ::= foo"), "grammar", "Rule 'foo' not found"),
    ],
)
def test_validate_errors(hf_compiler, constraint, param, words):
    for call in (hf_compiler.validate, hf_compiler.matcher):
        with pytest.raises(InvalidParameterError) as info:
            call(constraint)
        assert info.value.param == param
        assert words in info.value.message, info.value.message
        assert info.value.message.startswith("invalid ")


def test_regex_error_hides_the_lark_wrapper(hf_compiler):
    with pytest.raises(InvalidParameterError) as info:
        hf_compiler.validate(Constraint("regex", "a(b"))
    assert "start:" not in info.value.message


def test_engine_vocabulary_smaller_than_tokenizer_is_refused(hf_tokenizer):
    with pytest.raises(ValueError, match="smaller than the tokenizer"):
        ConstraintCompiler(hf_tokenizer, hf_tokenizer.vocab_size - 1)


def test_compiled_constraints_are_cached(hf_compiler):
    constraint = Constraint("regex", "a[0-9]")
    hf_compiler.validate(constraint)
    first, second = hf_compiler.matcher(constraint), hf_compiler.matcher(constraint)
    token = hf_compiler.tokenizer.encode("a", add_special_tokens=False)[0]
    first.consume(token)  # copies: advancing one leaves the other (and the template) alone
    a, b = hf_compiler.allocate(1), hf_compiler.allocate(1)
    first.fill(a[0])
    second.fill(b[0])
    assert not np.array_equal(a, b)
    hf_compiler.matcher(constraint).fill(a[0])
    np.testing.assert_array_equal(a, b)


def test_each_step_gets_its_own_mask_array(hf_tokenizer):
    """The masks of consecutive decode steps never share memory: on CPU a device array made
    from a host array may alias it, and a step can still be queued when the next step's masks
    are written (a refilled buffer let a constrained row sample a token its grammar forbids)."""
    import types

    import jax

    from metrale_jax.scheduler.grammar_slots import GrammarSlots

    slots = GrammarSlots(hf_tokenizer, vocab_size=hf_tokenizer.vocab_size + 40, num_slots=2)
    matcher, _ = slots.start(Constraint("regex", "[ab]{3,8}"))
    sequences = [types.SimpleNamespace(matcher=matcher, thinking=None), None]
    _, first = slots.step_inputs(sequences)
    on_device = jax.device_put(first)
    _, second = slots.step_inputs(sequences)
    assert not np.shares_memory(first, second)
    second[:] = 0xFFFFFFFF  # what refilling one buffer in place would do
    assert np.array_equal(np.asarray(on_device), first)
    allowed = np.unpackbits(first[0].view(np.uint8), bitorder="little").astype(bool)
    assert not allowed[hf_tokenizer.vocab_size:].any()  # padding ids stay forbidden
