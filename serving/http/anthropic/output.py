"""Anthropic content blocks from chat deltas, and the whole `message` body.

`Blocks` takes one choice's chat deltas (`content`, `reasoning_content`, `tool_calls`, as
`ChoiceStream` gives them) and returns the stream events they make (content_block_start /
_delta / _stop); it also keeps the blocks themselves, so a whole answer is the same deltas
fed at once. `Answer` is what a request's writers need: its prepared generation, id, model
and stop sequences.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from typing import Any

from serving.http.chat_output import ChoiceStream
from serving.http.generation import ChoiceState
from serving.http.handlers import Prepared


def new_id() -> str:
    """A message id: `msg_` and 24 hex characters."""
    return f"msg_{uuid.uuid4().hex[:24]}"


class Blocks:
    """One choice's content blocks, built from chat deltas; every method returns the
    stream events (dicts) of what it did."""

    def __init__(self) -> None:
        self.blocks: list[dict[str, Any]] = []
        self._open: str | None = None  # the open block's type
        self._call: int | None = None  # the open tool_use block's tool call index
        self._arguments: list[str] = []  # its JSON arguments so far
        self.cut: set[int] = set()  # tool_use blocks whose arguments are no whole JSON object

    def _start(self, block: dict[str, Any]) -> list[dict[str, Any]]:
        events = self.close()
        self.blocks.append(block)
        self._open = block["type"]
        start = {**block, "input": {}} if block["type"] == "tool_use" else dict(block)
        return [*events, {"type": "content_block_start", "index": len(self.blocks) - 1,
                          "content_block": start}]

    def _delta(self, delta: dict[str, Any]) -> dict[str, Any]:
        return {"type": "content_block_delta", "index": len(self.blocks) - 1, "delta": delta}

    def feed(self, delta: dict[str, Any]) -> list[dict[str, Any]]:
        """The events of one chat delta."""
        events: list[dict[str, Any]] = []
        if delta.get("reasoning_content"):
            text = delta["reasoning_content"]
            if self._open != "thinking":
                events += self._start({"type": "thinking", "thinking": "", "signature": ""})
            self.blocks[-1]["thinking"] += text
            events.append(self._delta({"type": "thinking_delta", "thinking": text}))
        if delta.get("content"):
            text = delta["content"]
            if self._open != "text":
                events += self._start({"type": "text", "text": ""})
            self.blocks[-1]["text"] += text
            events.append(self._delta({"type": "text_delta", "text": text}))
        for chunk in delta.get("tool_calls") or ():
            fn = chunk.get("function") or {}
            if self._open != "tool_use" or self._call != chunk.get("index"):
                events += self._start({"type": "tool_use", "id": chunk.get("id") or "",
                                       "name": fn.get("name") or "", "input": {}})
                self._call = chunk.get("index")
            if fn.get("arguments"):
                self._arguments.append(fn["arguments"])
                events.append(self._delta({"type": "input_json_delta",
                                           "partial_json": fn["arguments"]}))
        return events

    def close(self) -> list[dict[str, Any]]:
        """Closes the open block, if any (a tool_use block gets its parsed `input`)."""
        if self._open is None:
            return []
        if self._open == "tool_use":
            value = _input("".join(self._arguments))
            if value is None:  # a call cut short (max_tokens inside its arguments)
                self.cut.add(len(self.blocks) - 1)
            self.blocks[-1]["input"] = value if value is not None else {}
            self._arguments, self._call = [], None
        self._open = None
        return [{"type": "content_block_stop", "index": len(self.blocks) - 1}]


def _input(arguments: str) -> dict[str, Any] | None:
    """A tool call's arguments as its `input` object (None: no whole JSON object)."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


class Answer:
    """One Messages request's answer: its generation (one choice), id, model and the stop
    sequences it asked for."""

    def __init__(self, prep: Prepared, model: str, stop_sequences: Sequence[str] | None):
        self.prep = prep
        self.id = new_id()
        self.model = model
        self.stop_sequences = tuple(stop_sequences or ())

    @property
    def choice(self) -> ChoiceState:
        """The one choice."""
        return self.prep.gen.choices[0]

    def stream(self) -> ChoiceStream | None:
        """The choice's reasoning / tool-call shaper, or None (the text is the answer)."""
        return self.prep.output.stream() if self.prep.output is not None else None

    def stop(self, called: bool) -> tuple[str, str | None]:
        """(stop_reason, stop_sequence) of the finished choice."""
        c = self.choice
        if c.finish_reason == "length":
            return "max_tokens", None
        if called:
            return "tool_use", None
        if isinstance(c.stop_reason, str) and c.stop_reason in self.stop_sequences:
            return "stop_sequence", c.stop_reason
        return "end_turn", None

    def usage(self) -> dict[str, Any]:
        """Anthropic's usage: input tokens (those not read from the prefix cache), cache
        reads, output tokens."""
        gen = self.prep.gen
        cached = gen.cached_tokens
        return {"input_tokens": gen.prompt_tokens - cached, "output_tokens":
                gen.completion_tokens, "cache_read_input_tokens": cached,
                "cache_creation_input_tokens": 0}

    def envelope(self, content: list[dict[str, Any]], stop_reason: str | None,
                 stop_sequence: str | None, usage: dict[str, Any]) -> dict[str, Any]:
        """A `message` object."""
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model,
                "content": content, "stop_reason": stop_reason, "stop_sequence": stop_sequence,
                "usage": usage}


def deltas(answer: Answer, text: str) -> tuple[list[dict[str, Any]], bool]:
    """The chat deltas of a whole output `text`, and whether it called tools."""
    s = answer.stream()
    if s is None:
        return ([{"content": text}] if text else []), False
    return [*s.feed(text), *s.finish()], s.called


def message_body(answer: Answer) -> dict[str, Any]:
    """The non-streaming `message` of a finished answer."""
    blocks = Blocks()
    chat_deltas, called = deltas(answer, answer.choice.output)
    for d in chat_deltas:
        blocks.feed(d)
    blocks.close()
    reason, sequence = answer.stop(called)
    # A call cut by max_tokens is no call: no `tool_use` whose `input` is a guess (a client
    # would run the tool with it); the answer is what came before it, stop reason max_tokens.
    content = [b for i, b in enumerate(blocks.blocks) if i not in blocks.cut]
    return answer.envelope(content, reason, sequence, answer.usage())
