"""The tool fields of a chat request: `tools`, `tool_choice`, `parallel_tool_calls`, history.

Every check raises `InvalidParameterError` (HTTP 400) naming the parameter, before anything is
queued. `template_tool_calls` gives a history's tool calls the shape chat templates expect.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Sequence
from typing import Any

from metrale_jax.errors import InvalidParameterError

NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
MODES = ("none", "auto", "required")


@dataclasses.dataclass(frozen=True)
class ToolChoice:
    """What the request asks of tool calls.

    mode: "none" (never parse calls), "auto" (parse what the model writes), "required" (at
    least one call, enforced by a grammar) or "named" (exactly one call of `name`).
    max_calls: 1 under `parallel_tool_calls=false`, else None (no limit).
    """

    mode: str
    name: str | None = None
    max_calls: int | None = None

    @property
    def constrained(self) -> bool:
        """True when a grammar must enforce the call ("required" or a named function)."""
        return self.mode in ("required", "named")


def check_tools(tools: Sequence[Any] | None) -> list[str]:
    """Validates `tools` (function tools only); returns their names."""
    if tools is None:
        return []
    names: list[str] = []
    for i, tool in enumerate(tools):
        param = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise InvalidParameterError(f"{param} must be an object", param=param)
        if tool.get("type") != "function":
            raise InvalidParameterError(
                f"{param}.type must be 'function' (got {tool.get('type')!r}): only function "
                "tools are supported", param=f"{param}.type")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise InvalidParameterError(f"{param}.function must be an object",
                                        param=f"{param}.function")
        name = fn.get("name")
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise InvalidParameterError(
                f"{param}.function.name must be 1 to 64 letters, digits, '_', '-' or '.' "
                f"(got {name!r})", param=f"{param}.function.name")
        if name in names:
            raise InvalidParameterError(f"two tools are named {name!r}",
                                        param=f"{param}.function.name")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise InvalidParameterError(f"{param}.function.parameters must be a JSON schema "
                                        "object", param=f"{param}.function.parameters")
        if fn.get("description") is not None and not isinstance(fn["description"], str):
            raise InvalidParameterError(f"{param}.function.description must be a string",
                                        param=f"{param}.function.description")
        names.append(name)
    return names


def parse_tool_choice(tools: Sequence[Any] | None, choice: Any,
                parallel_tool_calls: bool | None = None) -> ToolChoice:
    """Validates `tools` and `tool_choice` together; returns what they ask for."""
    names = check_tools(tools)
    max_calls = 1 if parallel_tool_calls is False else None
    if choice is None:
        return ToolChoice("auto" if names else "none", max_calls=max_calls)
    if isinstance(choice, str):
        if choice not in MODES:
            raise InvalidParameterError(
                f"tool_choice must be 'none', 'auto', 'required' or a function "
                f"(got {choice!r})", param="tool_choice")
        if choice == "required" and not names:
            raise InvalidParameterError("tool_choice 'required' needs tools",
                                        param="tool_choice")
        return ToolChoice(choice if names else "none", max_calls=max_calls)
    if not isinstance(choice, dict) or choice.get("type") != "function":
        raise InvalidParameterError(
            "tool_choice must be 'none', 'auto', 'required' or "
            "{'type': 'function', 'function': {'name': ...}}", param="tool_choice")
    fn = choice.get("function")
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise InvalidParameterError("tool_choice.function.name must be a string",
                                    param="tool_choice.function.name")
    if name not in names:
        raise InvalidParameterError(
            f"tool_choice names the function {name!r}, which is not among the tools",
            param="tool_choice.function.name")
    return ToolChoice("named", name, 1)


def template_tool_calls(calls: Sequence[Any], index: int) -> list[dict[str, Any]]:
    """A history message's `tool_calls` as templates want them: `arguments` as a dict.

    OpenAI clients send `function.arguments` as JSON text; templates (Qwen's, Llama's) write
    it with `tojson` or iterate over it, so JSON objects become dicts (text that is no JSON
    object stays text, as vLLM leaves it).
    """
    out = []
    for j, call in enumerate(calls):
        param = f"messages[{index}].tool_calls[{j}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise InvalidParameterError(f"{param}.function.name must be a string",
                                        param=f"{param}.function.name")
        args = fn.get("arguments")
        if isinstance(args, str):
            try:
                decoded = json.loads(args)
            except ValueError:
                decoded = None
            if isinstance(decoded, dict):
                args = decoded
        out.append({**call, "type": call.get("type", "function"),
                    "function": {**fn, "arguments": args if args is not None else {}}})
    return out
