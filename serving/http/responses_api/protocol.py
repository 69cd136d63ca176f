"""POST /v1/responses: the request body, validated, and its conversion into the chat request
that does the work.

`input` (a string, or a list of items: messages, `function_call`, `function_call_output`,
`reasoning`) becomes chat `messages` (`instructions` as a system message first); function
tools in the Responses' flat shape become chat's nested ones; `text.format` becomes
`response_format`; `reasoning.effort` turns thinking on ("none" / "minimal": off);
`max_output_tokens` is `max_tokens`. Chat's sampling extensions (seed, top_k, stop, ...) pass
through unchanged. Anything the server cannot do (built-in tools, background, conversations)
is a 400 naming the parameter.
"""

from __future__ import annotations

from typing import Any

from pydantic import create_model

from metrale_jax.errors import InvalidParameterError
from metrale_jax.sampling_fields import openai_names
from serving.http.protocol import (
    ChatCompletionRequest,
    Priority,
    RequestBody,
    SamplingRequest,
    api_fields,
    parse,
)

SPELLED = openai_names("responses")
"""{chat field: the Responses field} of the sampling fields the Responses API names itself."""
PASSTHROUGH = (set(SamplingRequest.model_fields) - set(SPELLED) - {
    "model", "n", "stream", "stream_options", "user", "num_beams", "use_beam_search",
    "length_penalty", "early_stopping"}) | {
    "chat_template_kwargs", "enable_thinking", "thinking_budget", "suppress_tool_call"}
"""Chat request fields a Responses request may carry as they are (sampling extensions)."""

BUILTIN_TOOLS = ("file_search", "web_search", "web_search_preview", "computer_use_preview",
                 "computer", "code_interpreter", "image_generation", "mcp", "local_shell",
                 "shell", "apply_patch", "custom", "namespace", "tool_search")


class _ResponseBody(RequestBody):
    """The fields of POST /v1/responses besides its spellings of the sampling fields."""

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    metadata: dict[str, str] | None = None
    store: bool = True
    stream: bool = False
    previous_response_id: str | None = None
    user: str | None = None
    truncation: str | None = None
    background: bool | None = None
    conversation: Any = None
    priority: Priority = 0  # vLLM's (serving/http/protocol.py)
    prompt: Any = None
    include: list[str] | None = None

    def unknown_fields(self) -> list[str]:
        """Names of fields this server neither reads nor passes to the chat request."""
        return [k for k in super().unknown_fields() if k not in PASSTHROUGH]

    def check(self) -> None:
        """Refuses what the server does not do (raises `InvalidParameterError`)."""
        if self.background:
            raise InvalidParameterError("background responses are not supported",
                                        param="background")
        if self.conversation is not None:
            raise InvalidParameterError("conversations are not supported: use "
                                        "previous_response_id", param="conversation")
        if self.prompt is not None:
            raise InvalidParameterError("prompt templates are not supported", param="prompt")
        if self.truncation not in (None, "disabled"):
            raise InvalidParameterError("only truncation 'disabled' is supported",
                                        param="truncation")
        if isinstance(self.input, list) and not self.input and not self.previous_response_id:
            raise InvalidParameterError("input must not be empty", param="input")

    def chat_tools(self) -> list[dict[str, Any]] | None:
        """`tools` in chat's nested shape (a built-in tool is a 400)."""
        if self.tools is None:
            return None
        out = []
        for i, tool in enumerate(self.tools):
            kind = tool.get("type")
            if kind in BUILTIN_TOOLS or (isinstance(kind, str) and kind.startswith(
                    ("web_search", "computer", "code_interpreter", "file_search"))):
                raise InvalidParameterError(
                    f"built-in tool {kind!r} is not supported: only function tools",
                    param=f"tools[{i}]")
            if kind != "function" or not isinstance(tool.get("name"), str):
                raise InvalidParameterError(
                    "each tool must be {'type': 'function', 'name': ...}", param=f"tools[{i}]")
            fn: dict[str, Any] = {"name": tool["name"]}
            for key in ("description", "parameters", "strict"):
                if tool.get(key) is not None:
                    fn[key] = tool[key]
            out.append({"type": "function", "function": fn})
        return out

    def chat_tool_choice(self) -> str | dict[str, Any] | None:
        """`tool_choice` in chat's shape."""
        tc = self.tool_choice
        if tc is None or isinstance(tc, str):
            return tc
        if tc.get("type") == "function" and isinstance(tc.get("name"), str):
            return {"type": "function", "function": {"name": tc["name"]}}
        raise InvalidParameterError("tool_choice must be 'none', 'auto', 'required' or "
                                    "{'type': 'function', 'name': ...}", param="tool_choice")

    def response_format(self) -> dict[str, Any] | None:
        """`text.format` as chat's `response_format` (None for plain text)."""
        fmt = (self.text or {}).get("format")
        if fmt is None:
            return None
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        if kind == "text":
            return None
        if kind == "json_object":
            return {"type": "json_object"}
        if kind == "json_schema":
            if not isinstance(fmt.get("schema"), dict):
                raise InvalidParameterError("text.format.schema must be a JSON schema object",
                                            param="text.format.schema")
            spec = {"name": fmt.get("name") or "response", "schema": fmt["schema"]}
            if fmt.get("strict") is not None:
                spec["strict"] = fmt["strict"]
            return {"type": "json_schema", "json_schema": spec}
        raise InvalidParameterError("text.format.type must be 'text', 'json_object' or "
                                    "'json_schema'", param="text.format.type")

    def thinking(self) -> bool | None:
        """Thinking on or off from `reasoning.effort` (None: the template's default)."""
        summary = (self.reasoning or {}).get("summary")
        if summary not in (None, "auto", "concise", "detailed"):
            raise InvalidParameterError(
                f"reasoning.summary must be 'auto', 'concise' or 'detailed', not {summary!r}",
                param="reasoning.summary")
        effort = (self.reasoning or {}).get("effort")
        if effort is None:
            return None
        if effort not in ("none", "minimal", "low", "medium", "high", "xhigh"):
            raise InvalidParameterError(f"unknown reasoning effort {effort!r}",
                                        param="reasoning.effort")
        return effort not in ("none", "minimal")

    def input_items(self) -> list[dict[str, Any]]:
        """`input` as a list of items (a string is one user message)."""
        if isinstance(self.input, str):
            return [{"type": "message", "role": "user", "content": self.input}]
        return list(self.input)

    def chat_request(self, history: list[dict[str, Any]]) -> ChatCompletionRequest:
        """The chat request of this one: `history` (earlier items, from
        `previous_response_id`) then `input`, `instructions` first."""
        messages = []
        if self.instructions:
            messages.append({"role": "system", "content": self.instructions})
        messages.extend(items_to_messages(history, "previous_response_id"))
        messages.extend(items_to_messages(self.input_items(), "input"))
        if not messages:
            raise InvalidParameterError("input must not be empty", param="input")
        body: dict[str, Any] = {
            k: v for k, v in (self.model_extra or {}).items() if k in PASSTHROUGH}
        body.update(messages=messages, model=self.model, stream=self.stream,
                    keep_alive=self.keep_alive, priority=self.priority,
                    max_itl_ms=self.max_itl_ms)
        for chat, ours in SPELLED.items():
            if getattr(self, ours) is not None:
                body[chat] = getattr(self, ours)
        for key, value in (("user", self.user),
                           ("tools", self.chat_tools()), ("tool_choice", self.chat_tool_choice()),
                           ("parallel_tool_calls", self.parallel_tool_calls),
                           ("response_format", self.response_format()),
                           ("enable_thinking", self.thinking())):
            if value is not None:
                body[key] = value
        return parse(ChatCompletionRequest, body)


CreateResponseRequest = create_model(
    "CreateResponseRequest", __base__=_ResponseBody, __module__=__name__,
    **api_fields("responses"),
    __doc__="The body of POST /v1/responses (the fields this server reads; others are "
            "ignored): `_ResponseBody`'s and the Responses spellings of the sampling fields "
            "(`max_output_tokens`, `temperature`, `top_p`).")


def items_to_messages(items: list[dict[str, Any]], param: str) -> list[dict[str, Any]]:
    """Responses input (or output) items as chat messages: messages keep their role, function
    calls join the assistant message before them (or start one) as `tool_calls`, function call
    outputs become tool messages, reasoning goes to the next assistant message's
    `reasoning_content`. Raises `InvalidParameterError` naming `param[i]` for a bad item."""
    out: list[dict[str, Any]] = []
    reasoning: str | None = None
    for i, item in enumerate(items):
        where = f"{param}[{i}]"
        if not isinstance(item, dict):
            raise InvalidParameterError("each input item must be an object", param=where)
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise InvalidParameterError(f"unknown message role {role!r}",
                                            param=f"{where}.role")
            msg: dict[str, Any] = {"role": role,
                                   "content": _content(item.get("content"), where)}
            if role == "assistant" and reasoning is not None:
                msg["reasoning_content"], reasoning = reasoning, None
            out.append(msg)
        elif kind == "function_call":
            name, args = item.get("name"), item.get("arguments")
            call_id = item.get("call_id") or item.get("id")
            if not isinstance(name, str) or not isinstance(args, str) or not call_id:
                raise InvalidParameterError(
                    "a function_call item needs string name, arguments and call_id",
                    param=where)
            call = {"id": call_id, "type": "function",
                    "function": {"name": name, "arguments": args}}
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
            if reasoning is not None:
                out[-1]["reasoning_content"], reasoning = reasoning, None
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(item.get("call_id"), str):
                raise InvalidParameterError("a function_call_output item needs a call_id",
                                            param=f"{where}.call_id")
            text = output if isinstance(output, str) else _content(output, where)
            if not isinstance(text, str):
                text = "".join(p["text"] for p in text if p.get("type") == "text")
            out.append({"role": "tool", "tool_call_id": item["call_id"], "content": text})
        elif kind == "reasoning":
            parts = [*(item.get("content") or ()), *(item.get("summary") or ())]
            reasoning = "".join(p.get("text", "") for p in parts if isinstance(p, dict))
        else:
            raise InvalidParameterError(f"unsupported input item type {kind!r}",
                                        param=f"{where}.type")
    return out


def _content(content: Any, where: str) -> str | list[dict[str, Any]]:
    """A message's content as chat content (a string, or text and image parts)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidParameterError("content must be a string or a list of parts",
                                    param=f"{where}.content")
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        at = f"{where}.content[{j}]"
        if kind in ("input_text", "output_text", "text", "refusal"):
            text = part.get("text", part.get("refusal"))
            if not isinstance(text, str):
                raise InvalidParameterError("a text part needs a string text", param=at)
            parts.append({"type": "text", "text": text})
        elif kind == "input_image":
            url = part.get("image_url")
            if not isinstance(url, str):
                raise InvalidParameterError("input_image needs an image_url (a URL or a data "
                                            "URL); file_id is not supported", param=at)
            parts.append({"type": "image_url", "image_url": {"url": url}})
        else:
            raise InvalidParameterError(f"unsupported content part type {kind!r}", param=at)
    if all(p["type"] == "text" for p in parts):
        return "".join(p["text"] for p in parts)
    return parts


_CHAT_PARAMS = (("messages", "input"), ("max_completion_tokens", "max_output_tokens"),
                *((chat, ours) for chat, ours in SPELLED.items() if chat != ours),
                ("response_format", "text.format"), ("enable_thinking", "reasoning"))


def responses_param(param: str | None) -> str | None:
    """The Responses name of a chat request's parameter, for the errors of the chat request
    a Responses request became: `messages[i]...` is `input` (its items and messages need not
    line up), `max_tokens` is `max_output_tokens`, `tools[i].function.x` is `tools[i].x`,
    `tool_choice.function.name` is `tool_choice.name`, `response_format` is `text.format`."""
    if param is None:
        return None
    for chat, ours in _CHAT_PARAMS:
        if param == chat or param.startswith((chat + ".", chat + "[")):
            return ours
    return param.replace(".function.", ".")
