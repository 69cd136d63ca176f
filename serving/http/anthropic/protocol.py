"""The request bodies of Anthropic's Messages API and their conversion to a chat request.

A Messages request becomes a `ChatCompletionRequest` that /v1/chat/completions would serve:
`system` a system message; text blocks text; image blocks `image_url` parts (base64 sources
as data URLs); an assistant's `tool_use` blocks its `tool_calls` (input as JSON arguments)
and `thinking` blocks its `reasoning_content`; a user's `tool_result` blocks `tool` messages;
tools OpenAI function tools (`input_schema` as `parameters`); `tool_choice` auto / any /
tool / none as auto / required / a named function / none; `stop_sequences` as `stop`;
`thinking` enabled as the chat extensions `enable_thinking` and `thinking_budget` (adaptive:
thinking without a budget; disabled: `enable_thinking` false). `metadata` and other unknown
fields are accepted and ignored; chat's `seed`, `timeout` and `ignore_eos` extensions pass.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, create_model

from metrale_jax.errors import InvalidParameterError
from metrale_jax.sampling_fields import openai_names
from serving.http.protocol import ChatCompletionRequest, Priority, api_fields, parse

SPELLED = openai_names("anthropic")
"""{chat field: the Messages field} of the sampling fields a Messages request carries."""
CHAT_PARAMS = {**{chat: ours for chat, ours in SPELLED.items() if chat != ours},
               "thinking_budget": "thinking", "enable_thinking": "thinking",
               "parallel_tool_calls": "tool_choice", "max_completion_tokens": "max_tokens"}
"""Chat request fields and the Messages fields they came from (for errors' `param`)."""


def messages_param(param: str | None) -> str | None:
    """An error's chat `param` as the Messages request names it."""
    if param is None:
        return None
    head, dot, rest = param.partition(".")
    return CHAT_PARAMS.get(head, head) + dot + rest


class InputMessage(BaseModel):
    """One message: a role and a string or a list of content blocks."""

    model_config = ConfigDict(extra="allow")
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class _Request(BaseModel):
    """Fields count_tokens and messages share."""

    model_config = ConfigDict(extra="allow", protected_namespaces=())
    model: str
    messages: Annotated[list[InputMessage], Field(min_length=1)]
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    keep_alive: float | str | None = None  # Ollama's (serving/http/model_catalog.py)
    max_itl_ms: Annotated[float, Field(gt=0, allow_inf_nan=False)] | None = None  # Metrale's

    def unknown_fields(self) -> list[str]:
        """Fields the request sent that this server does not know (logged, ignored)."""
        return sorted((self.model_extra or {}).keys())

    def chat_fields(self) -> dict[str, Any]:
        """The chat request's fields (a dict for `ChatCompletionRequest`)."""
        out: dict[str, Any] = {"model": self.model,
                               "messages": chat_messages(self.system, self.messages),
                               "keep_alive": self.keep_alive, "max_itl_ms": self.max_itl_ms}
        if self.tools:
            out["tools"] = [_tool(t, i) for i, t in enumerate(self.tools)]
        if self.tool_choice is not None:
            choice, parallel = _tool_choice(self.tool_choice)
            out["tool_choice"] = choice
            if parallel is not None:
                out["parallel_tool_calls"] = parallel
        if self.thinking is not None:
            out.update(_thinking(self.thinking))
        return out

    def chat_request(self) -> ChatCompletionRequest:
        """The equivalent chat request (a 400 for what it cannot express)."""
        return parse(ChatCompletionRequest, self.chat_fields())


class _MessagesBody(_Request):
    """POST /v1/messages besides its spellings of the sampling fields (`max_tokens`,
    `stop_sequences`, `temperature`, `top_p`, `top_k`, and the extensions `seed` and
    `ignore_eos`)."""

    stream: bool = False
    metadata: dict[str, Any] | None = None
    # an extension, as chat has it: a deadline in seconds
    timeout: Annotated[float, Field(gt=0)] | None = None
    priority: Priority = 0  # an extension: vLLM's (serving/http/protocol.py)

    def chat_fields(self) -> dict[str, Any]:
        """The chat request's fields, sampling included (an empty `stop_sequences` is
        left out)."""
        out = super().chat_fields()
        out["stream"] = self.stream
        for chat, ours in SPELLED.items():
            value = getattr(self, ours)
            if value is not None and value != []:
                out[chat] = value
        if self.timeout is not None:
            out["timeout"] = self.timeout
        out["priority"] = self.priority
        return out


MessagesRequest = create_model(
    "MessagesRequest", __base__=_MessagesBody, __module__=__name__,
    **api_fields("anthropic"),
    __doc__="POST /v1/messages: `_MessagesBody`'s fields and the Messages spellings of the "
            "sampling fields (from `metrale_jax.sampling_fields.SPELLINGS`).")


class CountTokensRequest(_Request):
    """POST /v1/messages/count_tokens."""


def _text_of(blocks: str | list[dict[str, Any]], where: str) -> str:
    """The text of a system prompt or a tool result's content (text blocks only)."""
    if isinstance(blocks, str):
        return blocks
    parts = []
    for i, b in enumerate(blocks):
        if not isinstance(b, dict) or b.get("type") != "text" or not isinstance(b.get("text"),
                                                                                 str):
            raise InvalidParameterError(
                f"{where}.{i}: only text blocks are accepted here", param=f"{where}.{i}")
        parts.append(b["text"])
    return "\n".join(parts) if where == "system" else "".join(parts)


def _image_part(block: dict[str, Any], where: str) -> dict[str, Any]:
    """An image block as an OpenAI `image_url` part (base64 as a data URL)."""
    source = block.get("source")
    if isinstance(source, dict) and source.get("type") == "base64" \
            and isinstance(source.get("data"), str) and isinstance(source.get("media_type"), str):
        url = f"data:{source['media_type']};base64,{source['data']}"
    elif isinstance(source, dict) and source.get("type") == "url" \
            and isinstance(source.get("url"), str):
        url = source["url"]
    else:
        raise InvalidParameterError(
            f"{where}.source: an image needs a base64 source (media_type, data) or a url",
            param=f"{where}.source")
    return {"type": "image_url", "image_url": {"url": url}}


def _user(content: list[dict[str, Any]], where: str) -> list[dict[str, Any]]:
    """A user message's blocks as chat messages: tool results as `tool` messages, the rest
    as user messages (in order)."""
    out: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []

    def flush() -> None:
        if parts:
            images = any(p["type"] == "image_url" for p in parts)
            text = "".join(p["text"] for p in parts) if not images else None
            out.append({"role": "user", "content": text if text is not None else list(parts)})
            parts.clear()

    for i, b in enumerate(content):
        at = f"{where}.{i}"
        kind = b.get("type") if isinstance(b, dict) else None
        if kind == "text" and isinstance(b.get("text"), str):
            parts.append({"type": "text", "text": b["text"]})
        elif kind == "image":
            parts.append(_image_part(b, at))
        elif kind == "tool_result":
            if not isinstance(b.get("tool_use_id"), str):
                raise InvalidParameterError(f"{at}.tool_use_id: missing", param=f"{at}.tool_use_id")
            flush()
            text = _text_of(b.get("content") or "", f"{at}.content")
            if b.get("is_error"):
                text = f"Error: {text}"
            out.append({"role": "tool", "tool_call_id": b["tool_use_id"], "content": text})
        else:
            raise InvalidParameterError(
                f"{at}: a user message takes text, image and tool_result blocks (got "
                f"{kind!r})", param=at)
    flush()
    return out


def _assistant(content: list[dict[str, Any]], where: str) -> dict[str, Any]:
    """An assistant message's blocks as one chat message (text, reasoning, tool calls)."""
    text, thinking, calls = [], [], []
    for i, b in enumerate(content):
        at = f"{where}.{i}"
        kind = b.get("type") if isinstance(b, dict) else None
        if kind == "text" and isinstance(b.get("text"), str):
            text.append(b["text"])
        elif kind == "thinking" and isinstance(b.get("thinking"), str):
            thinking.append(b["thinking"])
        elif kind == "redacted_thinking":
            continue
        elif kind == "tool_use":
            if not isinstance(b.get("id"), str) or not isinstance(b.get("name"), str) \
                    or not isinstance(b.get("input"), dict):
                raise InvalidParameterError(
                    f"{at}: a tool_use block needs an id, a name and an input object", param=at)
            calls.append({"id": b["id"], "type": "function",
                          "function": {"name": b["name"],
                                       "arguments": json.dumps(b["input"], ensure_ascii=False)}})
        else:
            raise InvalidParameterError(
                f"{at}: an assistant message takes text, thinking and tool_use blocks (got "
                f"{kind!r})", param=at)
    msg: dict[str, Any] = {"role": "assistant", "content": "".join(text)}
    if thinking:
        msg["reasoning_content"] = "".join(thinking)
    if calls:
        msg["tool_calls"] = calls
    return msg


def chat_messages(system: str | list[dict[str, Any]] | None,
                  messages: list[InputMessage]) -> list[dict[str, Any]]:
    """The chat messages of a Messages request's `system` and `messages`."""
    out: list[dict[str, Any]] = []
    if system:
        out.append({"role": "system", "content": _text_of(system, "system")})
    for i, m in enumerate(messages):
        where = f"messages.{i}.content"
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
        elif m.role == "user":
            out.extend(_user(m.content, where))
        else:
            out.append(_assistant(m.content, where))
    return out


def _tool(tool: dict[str, Any], index: int) -> dict[str, Any]:
    """An Anthropic client tool as an OpenAI function tool."""
    at = f"tools.{index}"
    if tool.get("type") not in (None, "custom"):
        raise InvalidParameterError(
            f"{at}: only client tools (name, input_schema) are supported, not "
            f"{tool.get('type')!r}", param=at)
    if not isinstance(tool.get("name"), str) or not isinstance(tool.get("input_schema"), dict):
        raise InvalidParameterError(f"{at}: a tool needs a name and an input_schema object",
                                    param=at)
    fn: dict[str, Any] = {"name": tool["name"]}  # OpenAI's order: the template writes it
    if isinstance(tool.get("description"), str):
        fn["description"] = tool["description"]
    fn["parameters"] = tool["input_schema"]
    return {"type": "function", "function": fn}


def _tool_choice(choice: dict[str, Any]) -> tuple[Any, bool | None]:
    """(the chat `tool_choice`, `parallel_tool_calls` or None) of Anthropic's tool_choice."""
    kind = choice.get("type")
    parallel = False if choice.get("disable_parallel_tool_use") else None
    if kind == "auto":
        return "auto", parallel
    if kind == "any":
        return "required", parallel
    if kind == "none":
        return "none", None
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    raise InvalidParameterError(
        "tool_choice: type must be auto, any, none, or tool (with a name)", param="tool_choice")


def _thinking(thinking: dict[str, Any]) -> dict[str, Any]:
    """The chat fields of `thinking`: a budget when enabled, no thinking when disabled."""
    kind = thinking.get("type")
    if kind == "disabled":
        return {"enable_thinking": False}
    if kind == "adaptive":
        return {"enable_thinking": True}
    budget = thinking.get("budget_tokens")
    if kind == "enabled" and isinstance(budget, int) and not isinstance(budget, bool) \
            and budget >= 0:
        return {"enable_thinking": True, "thinking_budget": budget}
    raise InvalidParameterError(
        "thinking: type must be enabled (with budget_tokens, an integer >= 0), adaptive or "
        "disabled",
        param="thinking")
