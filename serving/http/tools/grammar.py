"""Grammars that make `tool_choice` "required" or a named function hold, in the model's format.

`tool_call_grammar(tools, choice, parser)` is a Lark grammar (llguidance's dialect) of the
calls as the served model writes them, each call object a `%json` schema built from the tools'
parameter schemas: so the output always parses with the same tool parser, and every call's
arguments validate against its function's schema.

- hermes: `<tool_call>\\n{"name": …, "arguments": …}\\n</tool_call>`, several separated by
  newlines unless `parallel_tool_calls` is false;
- llama3_json: `{"name": …, "parameters": …}`, several separated by `; `;
- mistral: `[TOOL_CALLS][{"name": …, "arguments": …}, …]`.

A marker that is a special token must be matched as that token, not as text: `special` maps
such marker texts to their ids and the grammar names them as `<[id]>`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from metrale_jax.errors import InvalidParameterError
from serving.http.tools.request import ToolChoice

EMPTY_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}
"""The schema of a function without `parameters` (OpenAI: an empty parameter list)."""


JSON_FORMAT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
"""How the calls' JSON is written: `{"name": "f", "arguments": {"a": 1}}`, as the models
write it (llguidance's default allows any whitespace, where small models ramble)."""


def call_schema(tool: Mapping[str, Any], args_key: str = "arguments") -> dict[str, Any]:
    """The JSON schema of one call object `{"name": <the name>, args_key: <parameters>}`."""
    fn = tool["function"]
    params = fn.get("parameters") or EMPTY_PARAMETERS
    return {"type": "object",
            "properties": {"name": {"const": fn["name"]}, args_key: params},
            "required": ["name", args_key], "additionalProperties": False}


def calls_schema(tools: Sequence[Mapping[str, Any]], choice: ToolChoice,
                 args_key: str = "arguments") -> dict[str, Any]:
    """The schema of one call of the tools `choice` allows (a union when several)."""
    chosen = [t for t in tools if choice.mode != "named" or t["function"]["name"] == choice.name]
    if not chosen:
        raise InvalidParameterError("no tool matches tool_choice", param="tool_choice")
    schemas = [call_schema(t, args_key) for t in chosen]
    return schemas[0] if len(schemas) == 1 else {"anyOf": schemas}


def _literal(text: str, special: Mapping[str, int]) -> str:
    """A Lark terminal for `text`: the special token `<[id]>`, or the quoted string."""
    return f"<[{special[text]}]>" if text in special else json.dumps(text)


def tool_call_grammar(tools: Sequence[Mapping[str, Any]], choice: ToolChoice, parser: str,
                      special: Mapping[str, int] | None = None) -> dict[str, str]:
    """`{"grammar": <Lark text>}` forcing the calls `choice` asks for, in `parser`'s format.

    Args:
        tools: the request's (validated) tools.
        choice: "required" (one or more calls; exactly one when `max_calls` is 1) or "named".
        parser: the tool-call format (`hermes`, `llama3_json`, `mistral`).
        special: marker texts that are special tokens, to their ids.
    """
    if not choice.constrained:
        raise ValueError(f"tool_choice {choice.mode!r} needs no grammar")
    special = special or {}
    many = choice.mode == "required" and choice.max_calls != 1
    args_key = "parameters" if parser == "llama3_json" else "arguments"
    schema = {"x-guidance": JSON_FORMAT, **calls_schema(tools, choice, args_key)}
    body = "%json " + json.dumps(schema, ensure_ascii=False)
    if parser == "hermes":
        call = f'{_literal("<tool_call>", special)} "\\n" body "\\n" ' \
               f'{_literal("</tool_call>", special)}'
        start = 'call ("\\n" call)* "\\n"?' if many else 'call "\\n"?'
        rules = [f"start: {start}", f"call: {call}"]
    elif parser == "llama3_json":
        rules = ['start: body ("; " body)*' if many else "start: body"]
    elif parser == "mistral":
        items = 'body (", " body)*' if many else "body"
        rules = [f'start: {_literal("[TOOL_CALLS]", special)} "[" {items} "]"']
    else:
        raise InvalidParameterError(f"no tool-call grammar for the {parser!r} format",
                                    param="tool_choice")
    return {"grammar": "\n".join([*rules, f"body: {body}"]) + "\n"}
