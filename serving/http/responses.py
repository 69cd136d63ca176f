"""OpenAI response bodies and stream chunks (chat.completion, text_completion, usage, SSE).

Pure functions of plain data: the handlers decide what to send, these decide its shape.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from metrale_jax.scheduler import TokenLogprob

UNLIKELY = -9999.0  # OpenAI's logprob of a token outside the top 20 (JSON has no -inf)


def new_id(prefix: str) -> str:
    """An OpenAI-style id: `chatcmpl-…` or `cmpl-…`."""
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    """`created`: Unix seconds."""
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """The `usage` object; `prompt_tokens_details.cached_tokens`: the prompt tokens whose keys
    and values came from the prefix cache."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def _lp(value: float) -> float:
    return value if math.isfinite(value) else UNLIKELY


def chat_logprobs(entries: Sequence[TokenLogprob], token_str: Callable[[int], str]) -> dict:
    """`choices[].logprobs` of a chat answer: `{"content": [...], "refusal": None}`."""
    def one(token_id: int, logprob: float) -> dict[str, Any]:
        s = token_str(token_id)
        return {"token": s, "logprob": _lp(logprob), "bytes": list(s.encode("utf-8"))}

    content = []
    for e in entries:
        item = one(e.token_id, e.logprob)
        item["top_logprobs"] = [one(i, lp) for i, lp in e.top]
        content.append(item)
    return {"content": content, "refusal": None}


def completion_logprobs(entries: Sequence[TokenLogprob], token_str: Callable[[int], str],
                        offset: int = 0) -> dict:
    """`choices[].logprobs` of a text completion (tokens, token_logprobs, top, offsets)."""
    tokens, lps, tops, offsets = [], [], [], []
    for e in entries:
        s = token_str(e.token_id)
        tokens.append(s)
        lps.append(_lp(e.logprob))
        tops.append({token_str(i): _lp(lp) for i, lp in e.top})
        offsets.append(offset)
        offset += len(s)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops,
            "text_offset": offsets}


def chat_message(text: str) -> dict[str, Any]:
    """The assistant `message` of a chat choice."""
    return {"role": "assistant", "content": text, "refusal": None}


class Envelope:
    """The fields every body and chunk of one answer shares (id, object, created, ...)."""

    def __init__(self, prefix: str, obj: str, model: str, fingerprint: str):
        self.id = new_id(prefix)
        self.object = obj
        self.created = now()
        self.model = model
        self.fingerprint = fingerprint

    def body(self, choices: list[dict], usage_: dict | None = None,
             include_usage_key: bool = True, obj: str | None = None) -> dict[str, Any]:
        """One JSON body (or chunk) with these choices and usage."""
        out: dict[str, Any] = {"id": self.id, "object": obj or self.object,
                               "created": self.created, "model": self.model,
                               "system_fingerprint": self.fingerprint, "choices": choices}
        if include_usage_key:
            out["usage"] = usage_
        return out


def sse(data: dict | str) -> bytes:
    """One server-sent event: `data: <json>` and a blank line."""
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False,
                                                         separators=(",", ":"))
    return f"data: {text}\n\n".encode()


DONE = sse("[DONE]")
