"""Every body and every stream chunk validates against OpenAI's spec."""

from __future__ import annotations

from tests.serving.conftest import MODEL, post, sse_events

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6,
        "temperature": 0}


def _chunks(events: list) -> list[dict]:
    assert events[-1] == "[DONE]"
    assert "[DONE]" not in events[:-1]
    return events[:-1]


def test_chat_bodies(base_url, schemas):
    for extra in ({}, {"n": 2, "temperature": 1, "seed": 1}, {"logprobs": True,
                                                               "top_logprobs": 2}):
        status, headers, body = post(base_url, "/v1/chat/completions", {**CHAT, **extra})
        assert status == 200 and headers.get("x-request-id")
        schemas.chat(body)


def test_chat_chunks(base_url, schemas):
    body = {**CHAT, "stream": True, "n": 2, "logprobs": True, "top_logprobs": 1,
            "stream_options": {"include_usage": True}}
    chunks = _chunks(sse_events(base_url, "/v1/chat/completions", body))
    for c in chunks:
        schemas.chat_chunk(c)
    assert {c["choices"][0]["delta"].get("role") for c in chunks[:2]} == {"assistant"}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] > 0
    assert all(c["usage"] is None for c in chunks[:-1])
    finals = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert sorted(c["choices"][0]["index"] for c in finals) == [0, 1]


def test_completion_bodies_and_chunks(base_url, schemas):
    body = {"model": MODEL, "prompt": ["hi", "yo"], "max_tokens": 4, "logprobs": 2}
    status, _, out = post(base_url, "/v1/completions", body)
    assert status == 200
    schemas.completion(out)
    chunks = _chunks(sse_events(base_url, "/v1/completions",
                                {**body, "stream": True,
                                 "stream_options": {"include_usage": True}}))
    for c in chunks:
        schemas.completion_chunk(c)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["prompt_tokens"] > 0


def test_error_bodies(base_url, schemas):
    status, headers, body = post(base_url, "/v1/chat/completions", b"{nope")
    assert status == 400 and headers.get("x-request-id")
    schemas.error(body)


def test_request_id_echoed(base_url):
    _, headers, _ = post(base_url, "/v1/models", b"", {"x-request-id": "abc123"}, method="GET")
    assert headers["x-request-id"] == "abc123"


def test_unknown_fields_named(base_url, schemas):
    status, headers, body = post(base_url, "/v1/chat/completions",
                                 {**CHAT, "frobnicate": 1, "zeta": True})
    assert status == 200
    schemas.chat(body)
    assert headers["x-metrale-ignored-fields"] == "frobnicate, zeta"
