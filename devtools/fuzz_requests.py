"""Hostile and spec-generated requests for the server, and the rule every answer must keep.

Shared by the suite's short fuzz profile (tests/serving/http/test_fuzz.py) and the long one
(bench/fuzz.py). Two sources of requests:

- `spec_strategies`: Hypothesis strategies of whole requests, built by Schemathesis from
  OpenAI's published spec (`../shared/openai-openapi.yaml`: every OpenAI route the server
  serves) and from an OpenAPI document made here of the Anthropic SDK's request types
  (`anthropic.types.MessageCreateParams`, `MessageCountTokensParams`, through pydantic's
  `TypeAdapter.json_schema`) and of vLLM's /tokenize and /detokenize bodies (the server's own
  pydantic models). Each route gets a positive strategy (bodies the schema allows) and a
  negative one (bodies it forbids: wrong types, missing fields, values out of range).
- `hostile_cases`: hand-written requests: lone surrogates and invalid UTF-8 wherever text
  goes, huge numbers, NaN/Infinity literals, deep nesting, wrong types in every field, image
  parts that are not images, bodies over the server's limit.

`check(request, outcome)` is the rule: a 2xx, or a 4xx whose body has the route's error shape
(OpenAI's `{"error": {"message", "type", "param", "code"}}`, Anthropic's `{"type": "error",
"error": {"type", "message"}}` under /v1/messages); never a 5xx, never a hang, and a stream
carries no server error event.
"""

from __future__ import annotations

import base64
import dataclasses
import http.client
import json
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

OPENAI_ROUTES = {  # the spec's path -> ours (its servers' base is /v1)
    "/chat/completions": "post", "/completions": "post", "/embeddings": "post",
    "/responses": "post", "/models": "get", "/models/{model}": "get"}
ANTHROPIC_PREFIX = "/v1/messages"
TOKEN_FIELDS = ("max_tokens", "max_completion_tokens", "max_output_tokens")
MAX_NEW_TOKENS = 4
"""Generated token budgets in [5, 10,000] are cut to this and absent ones set to it (the run
stays short); larger ones are sent as they are (the server must refuse what does not fit)."""
MAX_N = 2
"""Generated `n` / `best_of` above this become this (8 slots, a short run)."""


@dataclasses.dataclass(frozen=True)
class Request:
    """One HTTP request: `route` is its label ("POST /v1/chat/completions"), `body` the raw
    bytes sent (None for a GET), `note` what makes it hostile (hand-written cases)."""

    method: str
    path: str
    body: bytes | None = None
    note: str = ""

    @property
    def route(self) -> str:
        """The method and the path, with a path parameter's value replaced by `{id}`."""
        path = self.path
        if path.startswith("/v1/models/"):
            path = "/v1/models/{id}"
        return f"{self.method} {path}"

    @property
    def anthropic(self) -> bool:
        """Whether errors come in Anthropic's shape (every /v1/messages path)."""
        return self.path.startswith(ANTHROPIC_PREFIX)

    def shown(self, limit: int = 600) -> str:
        """The request for a report: method, path and the body's start."""
        body = "" if self.body is None else self.body[:limit].decode("utf-8", "replace")
        more = "" if self.body is None or len(self.body) <= limit else f"... ({len(self.body)} B)"
        return f"{self.method} {self.path} {self.note} {body}{more}".strip()


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What came back: `status` (None when the client timed out or the connection failed),
    `body` (the decoded JSON of a whole answer, else None), `text` (the raw answer's start),
    `stream_error` (a stream's error event, if it carried one)."""

    status: int | None
    body: Any = None
    text: str = ""
    stream_error: Any = None

    @property
    def kind(self) -> str:
        """"2xx", "4xx", "5xx" or "timeout" (no answer)."""
        return "timeout" if self.status is None else f"{self.status // 100}xx"


def json_bytes(value: Any) -> bytes:
    """`value` as JSON bytes; a lone surrogate is written as its `\\uXXXX` escape."""
    return json.dumps(value, ensure_ascii=True, allow_nan=True, default=repr).encode()


def send(base_url: str, req: Request, timeout: float = 60.0) -> Outcome:
    """Sends `req` over a fresh connection and reads the whole answer (a stream to its end)."""
    u = urlparse(base_url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    try:
        headers = {"Content-Type": "application/json"} if req.body is not None else {}
        conn.request(req.method, req.path, body=req.body, headers=headers)
        resp = conn.getresponse()
        raw = resp.read()
    except (TimeoutError, OSError, http.client.HTTPException) as e:
        return Outcome(None, text=f"{type(e).__name__}: {e}")
    finally:
        conn.close()
    text = raw.decode("utf-8", "replace")
    if "text/event-stream" in (resp.getheader("content-type") or ""):
        return Outcome(resp.status, text=text[:2000], stream_error=_stream_error(text))
    try:
        body = json.loads(raw) if raw else None
    except ValueError:
        body = None
    return Outcome(resp.status, body, text[:2000])


def _stream_error(text: str) -> Any:
    """The first server-side error event of an SSE answer, or None (a 4xx-like error event,
    e.g. a request refused once streaming began, is not one)."""
    for line in text.splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        try:
            event = json.loads(line[6:])
        except ValueError:
            return f"not JSON: {line[:200]}"
        if isinstance(event, dict):
            err = event.get("error")
            kind = err.get("type") if isinstance(err, dict) else None
            if kind in ("server_error", "api_error"):
                return event
    return None


def check(req: Request, out: Outcome) -> str | None:
    """Why `out` breaks the rule, or None: a 2xx; a 4xx in the route's error shape."""
    if out.status is None:
        return f"no answer: {out.text}"
    if out.status >= 500:
        return f"{out.status}: {out.text[:600]}"
    if out.stream_error is not None:
        return f"a server error in the stream: {out.stream_error}"
    if out.status < 400:
        return None
    problem = (_anthropic_shape if req.anthropic else _openai_shape)(out.body)
    return None if problem is None else f"{out.status} {problem}: {out.text[:400]}"


def _openai_shape(body: Any) -> str | None:
    err = body.get("error") if isinstance(body, dict) else None
    if not isinstance(err, dict):
        return "without an {'error': {...}} body"
    if not isinstance(err.get("message"), str) or not isinstance(err.get("type"), str):
        return "without an error message and type"
    if "param" not in err or "code" not in err:
        return "without the error's param and code"
    return None


def _anthropic_shape(body: Any) -> str | None:
    if not isinstance(body, dict) or body.get("type") != "error":
        return "without Anthropic's {'type': 'error', ...} body"
    err = body.get("error")
    if not isinstance(err, dict) or not all(isinstance(err.get(k), str)
                                            for k in ("type", "message")):
        return "without Anthropic's error type and message"
    return None


# ---- requests generated from the schemas ---------------------------------------------------


def _load_yaml(path: Path) -> dict[str, Any]:
    import yaml
    with open(path) as f:
        return yaml.load(f, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))


def openai_document(spec_path: Path) -> dict[str, Any]:
    """OpenAI's spec cut to the operations the server serves, its paths under /v1."""
    spec = _load_yaml(spec_path)
    paths = {}
    for path, method in OPENAI_ROUTES.items():
        op = spec["paths"][path][method]
        paths["/v1" + path] = {method: op}
    return {**spec, "paths": paths, "servers": [{"url": "/"}]}


def _body_op(schema: dict[str, Any]) -> dict[str, Any]:
    return {"post": {"requestBody": {"required": True, "content": {
        "application/json": {"schema": schema}}}, "responses": {"200": {"description": "ok"}}}}


_MESSAGE = {"type": "object", "required": ["role", "content"], "properties": {
    "role": {"enum": ["system", "user", "assistant", "tool"]},
    "content": {"anyOf": [{"type": "string"}, {"type": "null"}, {"type": "array", "items": {
        "type": "object", "properties": {"type": {"enum": ["text", "image_url"]},
                                         "text": {"type": "string"}}}}]}}}
VLLM_SCHEMAS: dict[str, dict[str, Any]] = {
    "/tokenize": {"type": "object", "properties": {
        "model": {"type": "string"}, "prompt": {"type": "string"},
        "messages": {"type": "array", "items": _MESSAGE},
        "add_special_tokens": {"type": "boolean"},
        "add_generation_prompt": {"type": "boolean"},
        "return_token_strs": {"type": "boolean"}}},
    "/detokenize": {"type": "object", "required": ["tokens"], "properties": {
        "model": {"type": "string"},
        "tokens": {"type": "array", "items": {"type": "integer", "minimum": 0}}}},
}
"""vLLM's /tokenize and /detokenize request bodies (no published OpenAPI spec of its own)."""


def local_document() -> dict[str, Any]:
    """An OpenAPI 3.1 document of the routes OpenAI's spec lacks: Anthropic's /v1/messages
    and /v1/messages/count_tokens (from the SDK's request types) and vLLM's /tokenize and
    /detokenize (`VLLM_SCHEMAS`, written from vLLM's documentation)."""
    from anthropic.types import MessageCountTokensParams, MessageCreateParams
    from pydantic import TypeAdapter

    ref = "#/components/schemas/{model}"
    components: dict[str, Any] = {}
    paths = {}
    sources = {ANTHROPIC_PREFIX: TypeAdapter(MessageCreateParams),
               ANTHROPIC_PREFIX + "/count_tokens": TypeAdapter(MessageCountTokensParams)}
    for path, adapter in sources.items():
        schema = adapter.json_schema(ref_template=ref)
        components.update(schema.pop("$defs", {}))
        paths[path] = _body_op(schema)
    for path, schema in VLLM_SCHEMAS.items():
        paths[path] = _body_op(schema)
    return {"openapi": "3.1.0", "info": {"title": "metrale-extra", "version": "1"},
            "servers": [{"url": "/"}], "paths": paths,
            "components": {"schemas": components}}


def spec_strategies(spec_path: Path, model: str) -> dict[str, Any]:
    """{route label: a Hypothesis strategy of `Request`s}: each route's positive and negative
    cases (one of the two, drawn), with `model` put in most bodies (a random model name stops
    a request at the model lookup), token budgets clamped (`adjust`)."""
    import schemathesis
    from hypothesis import strategies as st
    from schemathesis import GenerationMode

    out: dict[str, Any] = {}
    for document in (openai_document(spec_path), local_document()):
        schema = schemathesis.openapi.from_dict(document)
        for path, ops in document["paths"].items():
            for method in ops:
                op = schema[path][method.upper()]
                cases = st.one_of(op.as_strategy(GenerationMode.POSITIVE),
                                  op.as_strategy(GenerationMode.NEGATIVE))
                label = f"{method.upper()} {path.replace('{model}', '{id}')}"
                out[label] = st.builds(_request, cases, st.integers(0, 3), st.just(model))
    return out


def _request(case: Any, pick: int, model: str) -> Request:
    body = case.body
    path = case.formatted_path
    if path.startswith("/v1/models/") and pick:
        path = "/v1/models/" + model
    if case.method.upper() == "GET":
        return Request("GET", path)
    if body is None or body.__class__.__name__ == "NotSet":
        return Request(case.method.upper(), path, b"")
    if isinstance(body, bytes):  # a negative case may be raw bytes
        return Request(case.method.upper(), path, body)
    if isinstance(body, dict) and pick:
        body = adjust({**body, "model": model}, path)
    return Request(case.method.upper(), path, json_bytes(body))


BUDGET_FIELD = {"/v1/chat/completions": "max_tokens", "/v1/completions": "max_tokens",
                "/v1/responses": "max_output_tokens"}
"""The token budget each generating route's body gets when it names none (the default, the
rest of the context, would make every such request hundreds of steps)."""


def adjust(body: dict[str, Any], path: str = "") -> dict[str, Any]:
    """`body` with a token budget in [1, 10**4] cut to `MAX_NEW_TOKENS` (none given: set to
    it) and `n` / `best_of` over `MAX_N` cut to it (the spec allows values that would make
    the run long; larger budgets stay, for the server to refuse)."""
    out = dict(body)
    for key in TOKEN_FIELDS:
        value = out.get(key)
        if _is_int(value) and MAX_NEW_TOKENS < value <= 10_000:
            out[key] = MAX_NEW_TOKENS
    if path in BUDGET_FIELD and not any(out.get(key) is not None for key in TOKEN_FIELDS):
        out[BUDGET_FIELD[path]] = MAX_NEW_TOKENS
    for key in ("n", "best_of"):
        if _is_int(out.get(key)) and out[key] > MAX_N:
            out[key] = MAX_N
    return out


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# ---- hand-written hostile requests ---------------------------------------------------------

LONE = "a\ud800b"
"""A lone UTF-16 surrogate between two letters: JSON may escape one; it is no character."""

BAD_UTF8 = b"\xff\xfe\xc3\x28"
"""Bytes that are not UTF-8."""


def _png(width: int, height: int) -> bytes:
    """A PNG whose header claims `width` x `height` and whose data is one byte (truncated)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return (struct.pack(">I", len(data)) + kind + data
                + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header)
            + chunk(b"IDAT", zlib.compress(b"\x00")) + chunk(b"IEND", b""))


NOT_IMAGES = {
    "garbage base64": "data:image/png;base64,@@@not base64@@@",
    "base64 of text": "data:image/png;base64," + base64.b64encode(b"hello, world").decode(),
    "a data URL of text": "data:text/plain;base64," + base64.b64encode(b"hello").decode(),
    "a huge dimension header": "data:image/png;base64," + base64.b64encode(
        _png(100_000, 100_000)).decode(),
    "an empty data URL": "data:,",
    "a file URL": "file:///etc/passwd",
    "a URL of no host": "http://",
}
"""Image URLs that are no image (each must be a 400, on a text model and a vision one)."""


def _chat(model: str, **extra: Any) -> dict[str, Any]:
    return {"model": model, "max_tokens": 2,
            "messages": [{"role": "user", "content": "Hi"}], **extra}


def _tool(name: str = "get_tide", description: str = "tide", arg: str = "place") -> dict:
    return {"type": "function", "function": {"name": name, "description": description,
            "parameters": {"type": "object", "properties": {arg: {"type": "string"}}}}}


def text_fields(model: str) -> Iterator[tuple[str, str, dict[str, Any]]]:
    """(label, path, body) with `LONE` in one text field of each route, streamed and not."""
    m = model
    chat_cases = {
        "content": _chat(m, messages=[{"role": "user", "content": LONE}]),
        "a text part": _chat(m, messages=[{"role": "user", "content": [
            {"type": "text", "text": LONE}]}]),
        "system": _chat(m, messages=[{"role": "system", "content": LONE},
                                     {"role": "user", "content": "Hi"}]),
        "a name": _chat(m, messages=[{"role": "user", "content": "Hi", "name": LONE}]),
        "stop": _chat(m, stop=LONE),
        "a tool name": _chat(m, tools=[_tool(name=LONE)]),
        "a tool description": _chat(m, tools=[_tool(description=LONE)]),
        "a tool argument": _chat(m, tools=[_tool(arg=LONE)]),
        "tool call arguments": _chat(m, messages=[
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": None, "tool_calls": [{
                "id": "c1", "type": "function",
                "function": {"name": "f", "arguments": '{"a": "' + LONE + '"}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "ok"}]),
        "response_format name": _chat(m, response_format={
            "type": "json_schema", "json_schema": {"name": LONE, "schema": {}}}),
        "a logit_bias key": _chat(m, logit_bias={LONE: 1}),
        "user": _chat(m, user=LONE),
        "a metadata value": _chat(m, metadata={"k": LONE}),
        "a metadata key": _chat(m, metadata={LONE: "v"}),
    }
    for stream in (False, True):
        for label, body in chat_cases.items():
            yield f"chat {label}", "/v1/chat/completions", {**body, "stream": stream}
        yield "completion prompt", "/v1/completions", {
            "model": m, "prompt": LONE, "max_tokens": 2, "stream": stream}
        yield "completion prompt list", "/v1/completions", {
            "model": m, "prompt": ["ok", LONE], "max_tokens": 2, "stream": stream}
        yield "completion stop", "/v1/completions", {
            "model": m, "prompt": "Hi", "stop": [LONE], "max_tokens": 2, "stream": stream}
        yield "responses input", "/v1/responses", {
            "model": m, "input": LONE, "max_output_tokens": 2, "stream": stream}
        yield "responses input item", "/v1/responses", {
            "model": m, "input": [{"role": "user", "content": [
                {"type": "input_text", "text": LONE}]}], "max_output_tokens": 2,
            "stream": stream}
        yield "responses instructions", "/v1/responses", {
            "model": m, "input": "Hi", "instructions": LONE, "max_output_tokens": 2,
            "stream": stream}
        yield "messages content", ANTHROPIC_PREFIX, {
            "model": m, "max_tokens": 2, "stream": stream,
            "messages": [{"role": "user", "content": LONE}]}
        yield "messages block", ANTHROPIC_PREFIX, {
            "model": m, "max_tokens": 2, "stream": stream,
            "messages": [{"role": "user", "content": [{"type": "text", "text": LONE}]}]}
        yield "messages system", ANTHROPIC_PREFIX, {
            "model": m, "max_tokens": 2, "stream": stream, "system": LONE,
            "messages": [{"role": "user", "content": "Hi"}]}
    yield "count_tokens", ANTHROPIC_PREFIX + "/count_tokens", {
        "model": m, "messages": [{"role": "user", "content": LONE}]}
    yield "embeddings input", "/v1/embeddings", {"model": m, "input": LONE}
    yield "embeddings input list", "/v1/embeddings", {"model": m, "input": ["ok", LONE]}
    yield "tokenize prompt", "/tokenize", {"model": m, "prompt": LONE}
    yield "tokenize messages", "/tokenize", {
        "model": m, "messages": [{"role": "user", "content": LONE}]}
    yield "detokenize model", "/detokenize", {"model": LONE, "tokens": [1]}
    yield "rerank query", "/v1/rerank", {"model": m, "query": LONE, "documents": ["a"]}
    yield "score text", "/v1/score", {"model": m, "text_1": LONE, "text_2": "a"}


ROUTES_WITH_BODIES = ("/v1/chat/completions", "/v1/completions", "/v1/responses",
                      ANTHROPIC_PREFIX, ANTHROPIC_PREFIX + "/count_tokens", "/v1/embeddings",
                      "/tokenize", "/detokenize", "/v1/rerank", "/v1/score")


def _nested(depth: int) -> bytes:
    return b'{"model": "x", "messages": ' + b"[" * depth + b"]" * depth + b"}"


def raw_bodies(model: str, body_limit: int) -> Iterator[tuple[str, bytes]]:
    """(note, raw body) sent to every route with a body: bytes that are not JSON, not UTF-8,
    huge numbers, NaN, deep nesting, over the body limit."""
    m = json.dumps(model).encode()
    yield "invalid UTF-8", b'{"model": ' + m + b', "prompt": "' + BAD_UTF8 + b'"}'
    yield "invalid UTF-8 key", b'{"' + BAD_UTF8 + b'": 1}'
    yield "a lone surrogate escape", b'{"model": ' + m + b', "prompt": "\\udc00", ' \
        b'"messages": [{"role": "user", "content": "\\ud800"}], "input": "\\ud800"}'
    yield "not JSON", b"{not json"
    yield "empty", b""
    yield "a JSON array", b"[1, 2]"
    yield "a JSON string", b'"hello"'
    yield "null", b"null"
    yield "NaN literal", b'{"model": ' + m + b', "max_tokens": NaN, "temperature": NaN}'
    yield "Infinity literal", b'{"model": ' + m + b', "max_tokens": Infinity, ' \
        b'"top_p": -Infinity, "temperature": Infinity}'
    yield "1e308 everywhere", b'{"model": ' + m + b', "max_tokens": 1e308, ' \
        b'"temperature": 1e308, "n": 1e308, "seed": 1e308, "top_k": 1e308}'
    yield "1e309 (overflow)", b'{"model": ' + m + b', "max_tokens": 1e309}'
    yield "2**64", b'{"model": ' + m + b', "max_tokens": 18446744073709551616, ' \
        b'"seed": 18446744073709551616, "n": 18446744073709551616}'
    yield "-0", b'{"model": ' + m + b', "max_tokens": -0, "temperature": -0.0}'
    yield "a 5000-digit integer", b'{"model": ' + m + b', "max_tokens": ' + b"9" * 5000 + b"}"
    yield "10,000 levels of nesting", _nested(10_000)
    yield "100,000 levels of nesting", _nested(100_000)
    yield "over the body limit", b'{"model": ' + m + b', "prompt": "' \
        + b"a" * (body_limit + 1024) + b'"}'


WRONG_VALUES = (None, True, -1, 0, 2**64, 1e308, -1e308, "x", "", [], [None], {}, {"a": 1},
                [[[]]])
"""What every field of a valid body is set to in turn."""


def valid_bodies(model: str) -> dict[str, dict[str, Any]]:
    """A small valid body of each route with a body (its fields get `WRONG_VALUES`)."""
    return {
        "/v1/chat/completions": {**_chat(model), "temperature": 0.5, "top_p": 0.9, "n": 1,
                                 "stop": ["x"], "seed": 1, "logprobs": True, "top_logprobs": 1,
                                 "stream": False, "tools": [_tool()], "tool_choice": "auto",
                                 "response_format": {"type": "text"}, "user": "u",
                                 "logit_bias": {"1": 1}, "stream_options": None},
        "/v1/completions": {"model": model, "prompt": "Hi", "max_tokens": 2, "echo": False,
                            "logprobs": 1, "suffix": None, "best_of": 1, "stop": "x"},
        "/v1/responses": {"model": model, "input": "Hi", "max_output_tokens": 2,
                          "instructions": "Be brief.", "temperature": 0.5, "store": False,
                          "text": {"format": {"type": "text"}}, "reasoning": None},
        ANTHROPIC_PREFIX: {"model": model, "max_tokens": 2, "system": "Be brief.",
                           "messages": [{"role": "user", "content": "Hi"}],
                           "temperature": 0.5, "stop_sequences": ["x"], "top_k": 5,
                           "metadata": {"user_id": "u"}},
        ANTHROPIC_PREFIX + "/count_tokens": {"model": model, "messages": [
            {"role": "user", "content": "Hi"}]},
        "/v1/embeddings": {"model": model, "input": "Hi", "encoding_format": "float"},
        "/tokenize": {"model": model, "prompt": "Hi", "add_special_tokens": True},
        "/detokenize": {"model": model, "tokens": [1, 2]},
    }


def image_bodies(model: str) -> Iterator[tuple[str, str, dict[str, Any]]]:
    """(note, path, body) with an image part that is no image, on chat, Responses, Messages
    and /tokenize."""
    for note, url in NOT_IMAGES.items():
        part = {"type": "image_url", "image_url": {"url": url}}
        yield note, "/v1/chat/completions", _chat(model, messages=[
            {"role": "user", "content": [{"type": "text", "text": "What is it?"}, part]}])
        yield note, "/tokenize", {"model": model, "messages": [
            {"role": "user", "content": [part]}]}
        yield note, "/v1/responses", {"model": model, "max_output_tokens": 2, "input": [
            {"role": "user", "content": [{"type": "input_image", "image_url": url}]}]}
        if url.startswith("data:") and ";base64," in url:
            media, data = url[5:].split(";base64,", 1)
            yield note, ANTHROPIC_PREFIX, {"model": model, "max_tokens": 2, "messages": [
                {"role": "user", "content": [{"type": "image", "source": {
                    "type": "base64", "media_type": media, "data": data}}]}]}


def hostile_cases(model: str, body_limit: int) -> list[Request]:
    """Every hand-written hostile request (a few hundred)."""
    out = [Request("POST", path, json_bytes(body), f"lone surrogate: {label}")
           for label, path, body in text_fields(model)]
    for path in ROUTES_WITH_BODIES:
        out += [Request("POST", path, raw, note) for note, raw in raw_bodies(model, body_limit)]
    for path, body in valid_bodies(model).items():
        for field in body:
            for value in WRONG_VALUES:
                out.append(Request("POST", path, json_bytes({**body, field: value}),
                                   f"{field}={value!r:.40}"))
    out += [Request("POST", path, json_bytes(body), f"not an image: {note}")
            for note, path, body in image_bodies(model)]
    out += [Request("GET", "/v1/models/" + "%ff%fe"), Request("GET", "/v1/models/" + "x" * 5000),
            Request("GET", "/v1/responses/%ud800"), Request("DELETE", "/v1/responses/nope")]
    return out
