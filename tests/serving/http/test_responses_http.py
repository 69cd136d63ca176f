"""OpenAI's Responses API (POST /v1/responses) over real HTTP on the shared tiny servers.

The models are random, so these tests check shapes (every body and stream event against the
spec's schemas) and consistency: a greedy Responses answer is the greedy chat answer of the
same conversation (text, reasoning, tool calls, usage), streamed or not; max_output_tokens
cuts to status "incomplete"; function calls round-trip; stored responses continue; bad input
is a 400.
"""

from __future__ import annotations

import http.client
import json
from urllib.parse import urlparse

import jsonschema
import pytest

from tests.serving.conftest import MODEL, SPEC, TOOL_MODEL, post
from tests.serving.openai_schema import _root

TOOL = {"type": "function", "name": "get_weather", "description": "The weather of a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]}, "strict": False}
CHAT_TOOL = {"type": "function", "function": {k: TOOL[k] for k in (
    "name", "description", "parameters", "strict")}}


class ResponseSchemas:
    """Validators of the spec's `Response` and of each stream event by its `type`."""

    def __init__(self) -> None:
        root = _root(str(SPEC))
        schemas = root["components"]["schemas"]
        cls = jsonschema.Draft202012Validator

        def make(name: str):
            return cls({**root, "$ref": f"#/components/schemas/{name}"})

        self.response_validator = make("Response")
        self.events = {}
        for ref in schemas["ResponseStreamEvent"]["anyOf"]:
            name = ref["$ref"].rsplit("/", 1)[-1]
            kind = schemas[name]["properties"]["type"]["enum"][0]
            self.events[kind] = make(name)

    def response(self, body: dict) -> None:
        """A Response object."""
        self.response_validator.validate(body)

    def event(self, event: dict) -> None:
        """One stream event (its schema picked by its type)."""
        self.events[event["type"]].validate(event)


@pytest.fixture(scope="module")
def rschemas() -> ResponseSchemas:
    if not SPEC.exists():
        pytest.fail(f"{SPEC} is missing: the OpenAI spec must lie in ../shared/")
    return ResponseSchemas()


@pytest.fixture(scope="module")
def tool_url(tool_server) -> str:
    return tool_server.url


def respond(url: str, schemas: ResponseSchemas, **body) -> dict:
    """POST /v1/responses (greedy unless told), checked against the spec's Response."""
    status, _, out = post(url, "/v1/responses", {"model": MODEL, "temperature": 0, **body})
    assert status == 200, out
    schemas.response(out)
    return out


def chat(url: str, **body) -> dict:
    """POST /v1/chat/completions (greedy unless told)."""
    status, _, out = post(url, "/v1/chat/completions", {"model": MODEL, "temperature": 0,
                                                        **body})
    assert status == 200, out
    return out


def stream(url: str, schemas: ResponseSchemas, ends: tuple[str, ...] = (
        "response.completed", "response.incomplete"), **body) -> list[dict]:
    """The events of a streamed response, each checked: schema, `event:` line, sequence,
    the last one's type among `ends`."""
    u = urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=120)
    try:
        conn.request("POST", "/v1/responses", json.dumps(
            {"model": MODEL, "temperature": 0, **body, "stream": True}),
            {"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200, resp.read()
        assert resp.getheader("content-type", "").startswith("text/event-stream")
        text = resp.read().decode()
    finally:
        conn.close()
    events = []
    for block in text.split("\n\n"):
        if not block.strip():
            continue
        head, data = block.split("\n", 1)
        assert head.startswith("event: ") and data.startswith("data: "), block
        event = json.loads(data[len("data: "):])
        assert event["type"] == head[len("event: "):]
        schemas.event(event)
        events.append(event)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[-1]["type"] in ends
    return events


def replay(events: list[dict]) -> list[dict]:
    """The output items that the events' deltas build (checked against their .done events)."""
    items: dict[int, dict] = {}
    for e in events:
        t = e["type"]
        if t == "response.output_item.added":
            items[e["output_index"]] = {**e["item"], "text": ""}
        elif t in ("response.output_text.delta", "response.reasoning_text.delta",
                   "response.function_call_arguments.delta"):
            items[e["output_index"]]["text"] += e["delta"]
        elif t == "response.output_text.done" or t == "response.reasoning_text.done":
            assert e["text"] == items[e["output_index"]]["text"]
        elif t == "response.function_call_arguments.done":
            assert e["arguments"] == items[e["output_index"]]["text"]
        elif t == "response.output_item.done":
            items[e["output_index"]]["done"] = e["item"]
    assert all("done" in it for it in items.values())
    return [items[i]["done"] for i in sorted(items)]


def strip_ids(items: list[dict]) -> list[dict]:
    """Output items without their random ids (for comparing two answers)."""
    return [{k: v for k, v in it.items() if k not in ("id", "call_id")} for it in items]


def output_text(body: dict) -> str:
    """The text of a Response's message items."""
    return "".join(p["text"] for it in body["output"] if it["type"] == "message"
                   for p in it["content"])


def test_greedy_answer_is_the_chat_answer(base_url, rschemas):
    body = respond(base_url, rschemas, input="Hello there", instructions="Be brief.",
                   max_output_tokens=12, metadata={"k": "v"}, store=False)
    want = chat(base_url, messages=[{"role": "system", "content": "Be brief."},
                                    {"role": "user", "content": "Hello there"}], max_tokens=12)
    choice = want["choices"][0]
    assert body["object"] == "response" and body["id"].startswith("resp_")
    assert body["metadata"] == {"k": "v"} and body["instructions"] == "Be brief."
    assert output_text(body) == choice["message"]["content"]
    u = body["usage"]
    assert (u["input_tokens"], u["output_tokens"], u["total_tokens"]) == (
        want["usage"]["prompt_tokens"], want["usage"]["completion_tokens"],
        want["usage"]["total_tokens"])
    assert body["status"] == ("incomplete" if choice["finish_reason"] == "length"
                              else "completed")
    events = stream(base_url, rschemas, input="Hello there", instructions="Be brief.",
                    max_output_tokens=12, store=False)
    final = events[-1]["response"]
    assert strip_ids(replay(events)) == strip_ids(final["output"]) == strip_ids(body["output"])
    assert final["usage"] == body["usage"] and final["status"] == body["status"]


def test_max_output_tokens_is_incomplete(base_url, rschemas):
    body = respond(base_url, rschemas, input=[{"role": "user", "content": [
        {"type": "input_text", "text": "Count"}]}], max_output_tokens=3, ignore_eos=True)
    assert body["status"] == "incomplete"
    assert body["incomplete_details"] == {"reason": "max_output_tokens"}
    assert body["usage"]["output_tokens"] == 3
    assert body["output"][-1]["status"] == "incomplete"
    events = stream(base_url, rschemas, input="Count", max_output_tokens=3, ignore_eos=True)
    assert events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"]["usage"]["output_tokens"] == 3


def test_an_error_mid_stream_is_response_failed(base_url, rschemas):
    """A request past its deadline (the `timeout` extension) after the stream started ends
    with response.failed carrying the error."""
    events = stream(base_url, rschemas, ends=("response.failed",), input="Count",
                    max_output_tokens=200, ignore_eos=True, timeout=0.001)
    failed = events[-1]["response"]
    assert failed["status"] == "failed" and failed["error"]["message"]
    assert "usage" not in failed


def test_openai_client(client):
    plain = client.responses.create(model=MODEL, input="Hi", max_output_tokens=8,
                                    temperature=0, extra_body={"seed": 3})
    assert plain.object == "response" and plain.output[0].type == "message"
    kinds, text, final = [], "", None
    with client.responses.create(model=MODEL, input="Hi", max_output_tokens=8, temperature=0,
                                 extra_body={"seed": 3}, stream=True) as events:
        for event in events:
            kinds.append(event.type)
            if event.type == "response.output_text.delta":
                text += event.delta
            if event.type in ("response.completed", "response.incomplete"):
                final = event.response
    assert kinds[0] == "response.created" and final is not None
    assert text == plain.output_text == final.output_text
    assert final.usage.output_tokens == plain.usage.output_tokens


def test_json_schema_format_gives_valid_json(client):
    """text.format json_schema holds the random model to the schema (a seed whose walk
    rambles to max_output_tokens is skipped, as in test_constrained_http.py)."""
    schema = {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]},
                                               "n": {"type": "integer", "minimum": 0,
                                                     "maximum": 30}},
              "required": ["kind", "n"], "additionalProperties": False}
    fmt = {"type": "json_schema", "name": "thing", "schema": schema, "strict": True}
    done = 0
    for seed in range(3):
        body = client.responses.create(model=MODEL, input="JSON please", max_output_tokens=60,
                                       temperature=1.0, text={"format": fmt},
                                       extra_body={"seed": seed})
        if body.status == "completed":
            jsonschema.validate(json.loads(body.output_text), schema)
            done += 1
    assert done >= 2


def test_previous_response_id_continues_and_get_returns_it(base_url, rschemas):
    first = respond(base_url, rschemas, input="One", max_output_tokens=6)
    status, _, got = post(base_url, f"/v1/responses/{first['id']}", b"", method="GET")
    assert status == 200 and got == first
    second = respond(base_url, rschemas, input="Two", max_output_tokens=6,
                     previous_response_id=first["id"])
    assert second["previous_response_id"] == first["id"]
    want = chat(base_url, max_tokens=6, messages=[
        {"role": "user", "content": "One"},
        {"role": "assistant", "content": output_text(first)},
        {"role": "user", "content": "Two"}])
    assert output_text(second) == want["choices"][0]["message"]["content"]
    assert second["usage"]["input_tokens"] == want["usage"]["prompt_tokens"]
    status, _, gone = post(base_url, f"/v1/responses/{first['id']}", b"", method="DELETE")
    assert status == 200 and gone["deleted"] is True
    status, _, err = post(base_url, f"/v1/responses/{first['id']}", b"", method="GET")
    assert status == 404, err
    status, _, err = post(base_url, "/v1/responses", {
        "model": MODEL, "input": "x", "previous_response_id": first["id"]})
    assert status == 400 and err["error"]["param"] == "previous_response_id", err


def test_function_call_round_trip(tool_url, rschemas):
    """A forced call comes out as a function_call item (streamed the same); sending it back
    with its output continues as chat does from the same history."""
    base = {"model": TOOL_MODEL, "input": "weather?", "tools": [TOOL],
            "tool_choice": {"type": "function", "name": "get_weather"},
            "max_output_tokens": 120, "temperature": 1.0}
    call = None
    for seed in range(3):
        body = respond(tool_url, rschemas, **base, seed=seed)
        if body["status"] == "completed":
            call = body["output"][-1]
            break
    assert call is not None and call["type"] == "function_call"
    assert call["name"] == "get_weather" and call["status"] == "completed"
    jsonschema.validate(json.loads(call["arguments"]), TOOL["parameters"])
    events = stream(tool_url, rschemas, **base, seed=seed)
    assert strip_ids(replay(events)) == strip_ids(body["output"])
    assert any(e["type"] == "response.function_call_arguments.delta" for e in events)

    history = [{"role": "user", "content": "weather?"}, call,
               {"type": "function_call_output", "call_id": call["call_id"], "output": "sunny"}]
    follow = respond(tool_url, rschemas, model=TOOL_MODEL, input=history, tools=[TOOL],
                     max_output_tokens=16)
    want = chat(tool_url, model=TOOL_MODEL, tools=[CHAT_TOOL], max_tokens=16, messages=[
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call["call_id"], "type": "function",
             "function": {"name": "get_weather", "arguments": call["arguments"]}}]},
        {"role": "tool", "tool_call_id": call["call_id"], "content": "sunny"}])
    message = want["choices"][0]["message"]
    assert output_text(follow) == (message["content"] or "")
    assert [(c["name"], c["arguments"]) for c in follow["output"]
            if c["type"] == "function_call"] == [
        (c["function"]["name"], c["function"]["arguments"])
        for c in message.get("tool_calls", ())]
    assert follow["usage"]["input_tokens"] == want["usage"]["prompt_tokens"]


def test_reasoning_items(tool_url, rschemas):
    """reasoning.effort turns thinking on: the thinking is a reasoning item, as chat's
    reasoning_content, streamed with reasoning_text events."""
    body = respond(tool_url, rschemas, model=TOOL_MODEL, input="weather?",
                   reasoning={"effort": "high"}, max_output_tokens=16)
    want = chat(tool_url, model=TOOL_MODEL, messages=[{"role": "user", "content": "weather?"}],
                enable_thinking=True, max_tokens=16)
    message = want["choices"][0]["message"]
    reasoning = body["output"][0]
    assert reasoning["type"] == "reasoning" and reasoning["summary"] == []
    assert reasoning["content"][0]["text"] == message["reasoning_content"]
    assert output_text(body) == (message["content"] or "")
    assert 0 < body["usage"]["output_tokens_details"]["reasoning_tokens"] <= 16
    events = stream(tool_url, rschemas, model=TOOL_MODEL, input="weather?",
                    reasoning={"effort": "high"}, max_output_tokens=16)
    assert any(e["type"] == "response.reasoning_text.delta" for e in events)
    assert strip_ids(replay(events)) == strip_ids(body["output"])
    # reasoning.summary: the thinking is also the item's summary (no separate summarizer)
    ask = dict(model=TOOL_MODEL, input="weather?", max_output_tokens=16,
               reasoning={"effort": "high", "summary": "auto"})
    summed = respond(tool_url, rschemas, **ask)["output"][0]
    assert summed["summary"] == [{"type": "summary_text",
                                  "text": message["reasoning_content"]}]
    events = stream(tool_url, rschemas, **ask)
    deltas = [e["delta"] for e in events if e["type"] == "response.reasoning_summary_text.delta"]
    assert "".join(deltas) == message["reasoning_content"]
    assert strip_ids(replay(events))[0]["summary"] == summed["summary"]


def test_store_keeps_the_latest_per_owner():
    from serving.http.responses_api.store import ResponseStore, Stored
    store = ResponseStore(capacity=2)
    for i in range(3):
        store.put(Stored({"id": f"r{i}"}, [], owner="a"))
    assert store.get("r0", "a") is None  # the least recently used went out
    assert store.get("r2", "a") is not None and store.get("r2", "b") is None
    assert store.get("r2") is None and store.delete("r2") and store.get("r2", "a") is None


@pytest.mark.parametrize(("body", "param"), [
    ({"tools": [{"type": "web_search"}]}, "tools[0]"),
    ({"tools": [{"type": "code_interpreter", "container": {"type": "auto"}}]}, "tools[0]"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
     "input[0].content[0]"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
    ({"input": None}, "input"),
    ({"input": []}, "input"),
    ({"text": {"format": {"type": "yaml"}}}, "text.format.type"),
    ({"tool_choice": {"type": "file_search"}}, "tool_choice"),
    ({"reasoning": {"effort": "extreme"}}, "reasoning.effort"),
    ({"reasoning": {"summary": "verbose"}}, "reasoning.summary"),
    ({"background": True}, "background"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}]}]}, "input"),
    ({"tools": [{**TOOL, "name": "bad name"}], "tool_choice": "none"}, "tools[0].name"),
    ({"tool_choice": {"type": "function", "name": "nope"}}, "tool_choice.name"),
    ({"max_output_tokens": 10_000}, "input"),  # with the input, over the context
    ({"seed": "x"}, "seed"),
])
def test_bad_input_is_a_400(base_url, schemas, body, param):
    full = {"model": MODEL, "input": "hi", **body}
    if body.get("input", "") is None:
        del full["input"]
    status, _, err = post(base_url, "/v1/responses", full)
    assert status == 400, err
    schemas.error(err)
    assert err["error"]["param"] == param and err["error"]["type"] == "invalid_request_error"
