"""The tool fields of a request: validation (400s naming the field), history for templates,
and the grammars that enforce "required" and named tool choices."""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest

from metrale_jax.errors import InvalidParameterError
from serving.http.chat_output import single_token_markers
from serving.http.tools.grammar import tool_call_grammar
from serving.http.tools.parsers import PARSERS
from serving.http.tools.request import ToolChoice, parse_tool_choice, template_tool_calls

WEATHER = {"type": "object", "properties": {
    "city": {"enum": ["Paris", "Rome"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "weather",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "now"}}]


def named(name: str) -> dict:
    return {"type": "function", "function": {"name": name}}


def test_choices():
    assert parse_tool_choice(TOOLS, None) == ToolChoice("auto")
    assert parse_tool_choice(None, None) == ToolChoice("none")
    assert parse_tool_choice(None, "auto") == ToolChoice("none")
    assert parse_tool_choice(TOOLS, "none") == ToolChoice("none")
    assert parse_tool_choice(TOOLS, "required", False) == ToolChoice("required", max_calls=1)
    assert parse_tool_choice(TOOLS, named("now")) == ToolChoice("named", "now", 1)
    assert parse_tool_choice(TOOLS, named("now")).constrained


@pytest.mark.parametrize(("tools", "choice", "param", "match"), [
    (TOOLS, named("nope"), "tool_choice.function.name", "not among the tools"),
    (TOOLS, "sometimes", "tool_choice", "must be 'none', 'auto', 'required'"),
    (TOOLS, {"type": "function"}, "tool_choice.function.name", "must be a string"),
    (TOOLS, {"type": "custom", "custom": {}}, "tool_choice", "must be"),
    (None, "required", "tool_choice", "needs tools"),
    (None, named("now"), "tool_choice.function.name", "not among the tools"),
    ([{"type": "custom"}], None, "tools[0].type", "only function tools"),
    (["x"], None, "tools[0]", "must be an object"),
    ([{"type": "function"}], None, "tools[0].function", "must be an object"),
    ([{"type": "function", "function": {"name": "a b"}}], None, "tools[0].function.name",
     "letters, digits"),
    ([{"type": "function", "function": {"name": "a", "parameters": []}}], None,
     "tools[0].function.parameters", "JSON schema object"),
    ([TOOLS[1], TOOLS[1]], None, "tools[1].function.name", "two tools"),
])
def test_bad_tools_and_choices_name_the_parameter(tools, choice, param, match):
    with pytest.raises(InvalidParameterError, match=match) as err:
        parse_tool_choice(tools, choice)
    assert err.value.param == param and err.value.status == 400


def test_history_arguments_become_dicts():
    calls = [{"id": "call_1", "type": "function",
              "function": {"name": "f", "arguments": '{"a": [1, 2]}'}},
             {"id": "call_2", "function": {"name": "g", "arguments": "not json"}},
             {"id": "call_3", "function": {"name": "h", "arguments": {"already": "dict"}}}]
    out = template_tool_calls(calls, 2)
    assert [c["function"]["arguments"] for c in out] == [
        {"a": [1, 2]}, "not json", {"already": "dict"}]
    assert all(c["type"] == "function" for c in out) and out[0]["id"] == "call_1"
    with pytest.raises(InvalidParameterError) as err:
        template_tool_calls([{"function": {"arguments": "{}"}}], 3)
    assert err.value.param == "messages[3].tool_calls[0].function.name"


def test_grammar_text():
    g = tool_call_grammar(TOOLS, parse_tool_choice(TOOLS, named("now")), "hermes",
                          special={"<tool_call>": 5})["grammar"]
    assert g.startswith('start: call "\\n"?\ncall: <[5]> ') and '"</tool_call>"' in g
    assert '"const": "now"' in g and "get_weather" not in g
    g = tool_call_grammar(TOOLS, parse_tool_choice(TOOLS, "required"), "llama3_json")["grammar"]
    assert 'start: body ("; " body)*' in g and '"parameters"' in g
    with pytest.raises(ValueError):
        tool_call_grammar(TOOLS, ToolChoice("auto"), "hermes")


def _walk(compiler, constraint, rng, max_steps=400) -> list[int] | None:
    """A random walk through the tokens the grammar allows; None if it never ends."""
    matcher = compiler.matcher(constraint)
    out: list[int] = []
    for _ in range(max_steps):
        row = compiler.allocate(1)[0]
        matcher.fill(row)
        bits = np.unpackbits(row.view(np.uint8), bitorder="little")[:compiler.vocab_size]
        token = int(rng.choice(np.nonzero(bits)[0]))
        if token in compiler.eos_token_ids:
            return out
        matcher.consume(token)
        out.append(token)
    return None


@pytest.mark.parametrize("fmt", sorted(PARSERS))
@pytest.mark.parametrize("choice", ["required", named("get_weather"), named("now")])
def test_grammar_output_parses_into_valid_calls(tool_tokenizer, fmt, choice):
    """Random walks under each grammar always parse, with the same tool parser, into calls of
    the allowed functions whose arguments validate against their schemas."""
    pytest.importorskip("llguidance")
    from metrale_jax.scheduler.constraints import Constraint, ConstraintCompiler
    compiler = ConstraintCompiler(tool_tokenizer)
    spec = parse_tool_choice(TOOLS, choice)
    special = single_token_markers(tool_tokenizer, PARSERS[fmt].markers)
    grammar = tool_call_grammar(TOOLS, spec, fmt, special=special)["grammar"]
    constraint = Constraint("grammar", grammar)
    compiler.validate(constraint)
    schemas = {t["function"]["name"]: t["function"].get("parameters") for t in TOOLS}
    rng = np.random.default_rng(0)
    finished = 0
    for _ in range(12):
        ids = _walk(compiler, constraint, rng)
        if ids is None:
            continue
        finished += 1
        text = tool_tokenizer.decode(ids, skip_special_tokens=False)
        parsed = PARSERS[fmt]().parse(text)
        assert parsed.content is None and parsed.tool_calls, text
        if spec.mode == "named":
            assert [c.name for c in parsed.tool_calls] == [spec.name]
        for call in parsed.tool_calls:
            jsonschema.validate(json.loads(call.arguments),
                                schemas[call.name] or {"type": "object", "maxProperties": 0})
    assert finished >= 6
