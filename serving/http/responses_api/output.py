"""Chat deltas (`{"content"}`, `{"reasoning_content"}`, `{"tool_calls": [...]}`, as
`ChoiceStream` gives them) into Responses output items and their stream events.

`OutputBuilder.feed(delta)` returns the events that delta makes (dicts without
`sequence_number`): a new item opens with `response.output_item.added` (a message also with
`response.content_part.added`), text goes out as `response.output_text.delta`,
`response.reasoning_text.delta` or `response.function_call_arguments.delta`, and an item
closes (its `.done` events, then `response.output_item.done`) when the next one opens or at
`finish`. `items` is the `output` array so far. A non-streamed answer feeds every delta and
keeps only `items`, so both answers are the same.

With `summary` (the request's `reasoning.summary`: "auto", "concise" or "detailed"), a
reasoning item closes with its thinking also as its one `summary_text` part (this server has
no separate summarizer: the thinking is the summary), sent as the
`response.reasoning_summary_part.*` and `response.reasoning_summary_text.*` events.
"""

from __future__ import annotations

import uuid
from typing import Any

Event = dict[str, Any]


def new_id(prefix: str) -> str:
    """An id as OpenAI writes them: `resp_…`, `msg_…`, `fc_…`, `rs_…`."""
    return f"{prefix}_{uuid.uuid4().hex}"


class OutputBuilder:
    """The output items of one answer, built from chat deltas (see the module docstring)."""

    def __init__(self, summary: bool = False) -> None:
        self.summary = summary
        self.items: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None  # the item being written
        self._call_index: int | None = None  # chat's tool-call index of an open call

    # ---- input ---------------------------------------------------------------------------
    def feed(self, delta: dict[str, Any]) -> list[Event]:
        """The events of one chat delta."""
        out: list[Event] = []
        if delta.get("reasoning_content"):
            out += self._text("reasoning", delta["reasoning_content"])
        if delta.get("content"):
            out += self._text("message", delta["content"])
        for chunk in delta.get("tool_calls") or ():
            out += self._call(chunk)
        return out

    def finish(self, status: str = "completed") -> list[Event]:
        """Closes the open item with `status` ("completed" or "incomplete"); an answer with
        no item at all gets an empty message (its `output_text` is "")."""
        out: list[Event] = []
        if not self.items:
            out += self._start("message")
        out += self._close(status)
        return out

    @property
    def text(self) -> str:
        """The answer's text (every message item's output_text joined)."""
        return "".join(p["text"] for it in self.items if it["type"] == "message"
                       for p in it["content"])

    @property
    def reasoning(self) -> str:
        """The answer's reasoning text."""
        return "".join(p["text"] for it in self.items if it["type"] == "reasoning"
                       for p in it["content"])

    # ---- items ---------------------------------------------------------------------------
    def _text(self, kind: str, text: str) -> list[Event]:
        out: list[Event] = []
        if self._open is None or self._open["type"] != kind:
            out += self._close("completed")
            out += self._start(kind)
        item = self._open
        assert item is not None
        item["content"][0]["text"] += text
        where = self._where()
        if kind == "message":
            out.append({"type": "response.output_text.delta", **where, "content_index": 0,
                        "delta": text, "logprobs": []})
        else:
            out.append({"type": "response.reasoning_text.delta", **where, "content_index": 0,
                        "delta": text})
        return out

    def _call(self, chunk: dict[str, Any]) -> list[Event]:
        out: list[Event] = []
        fn = chunk.get("function") or {}
        if self._open is None or self._call_index != chunk.get("index"):
            out += self._close("completed")
            out += self._start("function_call", call_id=chunk.get("id") or new_id("call"),
                               name=fn.get("name", ""))
            self._call_index = chunk.get("index")
        elif fn.get("name"):
            self._open["name"] += fn["name"]
        args = fn.get("arguments") or ""
        if args:
            self._open["arguments"] += args
            out.append({"type": "response.function_call_arguments.delta", **self._where(),
                        "delta": args})
        return out

    def _where(self) -> dict[str, Any]:
        assert self._open is not None
        return {"item_id": self._open["id"], "output_index": len(self.items) - 1}

    def _start(self, kind: str, call_id: str = "", name: str = "") -> list[Event]:
        if kind == "message":
            item = {"type": "message", "id": new_id("msg"), "role": "assistant",
                    "status": "in_progress", "content": []}
        elif kind == "reasoning":
            item = {"type": "reasoning", "id": new_id("rs"), "summary": [], "content": [],
                    "status": "in_progress"}
        else:
            item = {"type": "function_call", "id": new_id("fc"), "call_id": call_id,
                    "name": name, "arguments": "", "status": "in_progress"}
        self.items.append(item)
        self._open = item
        out: list[Event] = [{"type": "response.output_item.added",
                             "output_index": len(self.items) - 1, "item": _copy(item)}]
        if kind == "message":
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            item["content"].append(part)
            out.append({"type": "response.content_part.added", **self._where(),
                        "content_index": 0, "part": dict(part)})
        elif kind == "reasoning":
            item["content"].append({"type": "reasoning_text", "text": ""})
        return out

    def _close(self, status: str) -> list[Event]:
        item = self._open
        if item is None:
            return []
        where = self._where()
        out: list[Event] = []
        if item["type"] == "message":
            part = item["content"][0]
            out.append({"type": "response.output_text.done", **where, "content_index": 0,
                        "text": part["text"], "logprobs": []})
            out.append({"type": "response.content_part.done", **where, "content_index": 0,
                        "part": dict(part)})
        elif item["type"] == "reasoning":
            text = item["content"][0]["text"]
            out.append({"type": "response.reasoning_text.done", **where, "content_index": 0,
                        "text": text})
            if self.summary:
                out += self._summary(item, text, where)
        else:
            out.append({"type": "response.function_call_arguments.done", **where,
                        "name": item["name"], "arguments": item["arguments"]})
        item["status"] = status
        out.append({"type": "response.output_item.done", "output_index": where["output_index"],
                    "item": _copy(item)})
        self._open, self._call_index = None, None
        return out


    @staticmethod
    def _summary(item: dict[str, Any], text: str, where: dict[str, Any]) -> list[Event]:
        """The events of a reasoning item's summary part (its whole thinking)."""
        part = {"type": "summary_text", "text": text}
        item["summary"] = [dict(part)]
        at = {**where, "summary_index": 0}
        return [{"type": "response.reasoning_summary_part.added", **at,
                 "part": {"type": "summary_text", "text": ""}},
                {"type": "response.reasoning_summary_text.delta", **at, "delta": text},
                {"type": "response.reasoning_summary_text.done", **at, "text": text},
                {"type": "response.reasoning_summary_part.done", **at, "part": dict(part)}]


def _copy(item: dict[str, Any]) -> dict[str, Any]:
    return {k: [dict(p) for p in v] if isinstance(v, list) else v for k, v in item.items()}
