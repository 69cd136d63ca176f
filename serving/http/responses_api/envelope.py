"""The Response object around the output items: the request's settings echoed, status,
incomplete details, error and usage (the spec's `Response` schema)."""

from __future__ import annotations

import time
from typing import Any

from metrale_jax.sampling_fields import FIELD
from serving.http.responses_api.protocol import CreateResponseRequest


class Envelope:
    """What every Response object of one answer shares (id, created_at, the echoed request).

    body(status, output, usage, error) is the whole `Response` object.
    """

    def __init__(self, response_id: str, req: CreateResponseRequest, model: str):
        self.id = response_id
        self.created_at = int(time.time())
        self.req = req
        self.model = model

    def body(self, status: str, output: list[dict[str, Any]],
             usage: dict[str, Any] | None = None,
             error: dict[str, Any] | None = None) -> dict[str, Any]:
        """The `Response` object: status "in_progress", "completed", "incomplete" (cut by
        max_output_tokens or the context) or "failed" (with `error` {code, message})."""
        req = self.req
        tools = [{"type": "function", "name": t.get("name"),
                  "description": t.get("description"), "parameters": t.get("parameters"),
                  "strict": t.get("strict")} for t in req.tools or ()]
        text = req.text if req.text and req.text.get("format") else {"format": {"type": "text"}}
        body = {
            "id": self.id, "object": "response", "created_at": self.created_at,
            "status": status,
            "completed_at": int(time.time()) if status == "completed" else None,
            "error": error,
            "incomplete_details": {"reason": "max_output_tokens"}
            if status == "incomplete" else None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "model": self.model, "output": output,
            "parallel_tool_calls": True if req.parallel_tool_calls is None
            else req.parallel_tool_calls,
            "previous_response_id": req.previous_response_id,
            "reasoning": req.reasoning, "store": req.store,
            "temperature": FIELD["temperature"].default if req.temperature is None
            else req.temperature,
            "text": text, "tool_choice": req.tool_choice or "auto", "tools": tools,
            "top_p": FIELD["top_p"].default if req.top_p is None else req.top_p,
            "truncation": "disabled",
            "metadata": req.metadata or {},
        }
        if usage is not None:  # not nullable in the spec: absent until known
            body["usage"] = usage
        if req.user is not None:  # the spec's `user` is a string, never null
            body["user"] = req.user
        return body


def response_usage(chat_usage: dict[str, Any], reasoning_tokens: int) -> dict[str, Any]:
    """The Responses `usage` of a chat `usage` (reasoning tokens counted by the caller)."""
    cached = (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"input_tokens": chat_usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
            "output_tokens": chat_usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": chat_usage["total_tokens"]}
