"""Anthropic's Messages API over real HTTP, driven by the official `anthropic` client and raw
requests: the shared tiny server (plain text) and the tool server (hermes tool calls, <think>
tags). The models are random, so the checks are shapes (the SDK's own types, strict) and
consistency with /v1/chat/completions on the same conversation: greedy text, usage, the
rendered prompt, the parsed tool calls and thinking.
"""

from __future__ import annotations

import dataclasses
import http.client
import json
from urllib.parse import urlparse

import anthropic
import pytest
from anthropic.types import ErrorResponse, Message, RawMessageStreamEvent
from pydantic import TypeAdapter

from tests.serving.conftest import MODEL, TOOL_MODEL, post, wait_healthy

EVENT = TypeAdapter(RawMessageStreamEvent)
GREEDY = {"temperature": 0}  # this SDK's create() has no sampling arguments: sent as extras
SYSTEM = "You are terse."
USER = [{"role": "user", "content": "Say hello."}]
TOOL = {"name": "get_weather", "description": "The weather of a city.", "input_schema": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
OPENAI_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather of a city.",
    "parameters": TOOL["input_schema"]}}


def sdk(url: str, key: str = "x") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key=key, max_retries=0, timeout=120)


def message(url: str, **body) -> dict:
    """A whole /v1/messages answer (200), validated against the SDK's `Message`, strictly."""
    status, _, out = post(url, "/v1/messages", body)
    assert status == 200, out
    Message.model_validate(out, strict=True)
    assert out["id"].startswith("msg_") and out["type"] == "message"
    return out


def chat(url: str, **body) -> dict:
    status, _, out = post(url, "/v1/chat/completions", body)
    assert status == 200, out
    return out


def events(url: str, body: dict) -> list[dict]:
    """A streamed /v1/messages answer's events; each names its type in `event:` and
    validates as the SDK's `RawMessageStreamEvent`."""
    u = urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=120)
    try:
        conn.request("POST", "/v1/messages", json.dumps({**body, "stream": True}),
                     {"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200, resp.read()
        assert resp.getheader("content-type", "").startswith("text/event-stream")
        out, name = [], None
        for raw in resp:
            line = raw.decode().rstrip("\n")
            if line.startswith("event: "):
                name = line[len("event: "):]
            elif line.startswith("data: "):
                data = json.loads(line[len("data: "):])
                assert data["type"] == name
                if name == "error":
                    ErrorResponse.model_validate(data, strict=True)
                elif name != "ping":
                    EVENT.validate_python(data)
                out.append(data)
        return out
    finally:
        conn.close()


def assembled(evs: list[dict]) -> dict:
    """The message a stream's events make (content blocks with parsed tool inputs)."""
    kinds = [e["type"] for e in evs if e["type"] != "ping"]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    msg = evs[0]["message"]
    blocks, partial = [], {}
    for e in evs:
        if e["type"] == "content_block_start":
            assert e["index"] == len(blocks)
            blocks.append(dict(e["content_block"]))
        elif e["type"] == "content_block_delta":
            d, b = e["delta"], blocks[e["index"]]
            if d["type"] == "text_delta":
                b["text"] += d["text"]
            elif d["type"] == "thinking_delta":
                b["thinking"] += d["thinking"]
            else:
                partial[e["index"]] = partial.get(e["index"], "") + d["partial_json"]
        elif e["type"] == "content_block_stop":
            if blocks[e["index"]]["type"] == "tool_use":
                blocks[e["index"]]["input"] = json.loads(partial.get(e["index"]) or "{}")
        elif e["type"] == "message_delta":
            msg = {**msg, **e["delta"], "usage": {**msg["usage"], **e["usage"]}}
    return {**msg, "content": blocks}


def without_ids(content: list[dict]) -> list[dict]:
    return [{k: v for k, v in b.items() if k != "id"} for b in content]


def text_of(msg: dict) -> str:
    return "".join(b["text"] for b in msg["content"] if b["type"] == "text")


# ---- the tiny server: text ----------------------------------------------------------------

def test_text_is_chat_greedy_text_with_its_usage(base_url):
    msg = message(base_url, model=MODEL, system=SYSTEM, messages=USER, max_tokens=8,
                  temperature=0, metadata={"user_id": "u1"})
    ref = chat(base_url, model=MODEL, messages=[{"role": "system", "content": SYSTEM}, *USER],
               max_tokens=8, temperature=0)
    choice = ref["choices"][0]
    assert text_of(msg) == choice["message"]["content"]
    assert msg["stop_reason"] == ("max_tokens" if choice["finish_reason"] == "length"
                                  else "end_turn")
    assert msg["model"] == MODEL and msg["role"] == "assistant"
    usage = msg["usage"]
    assert usage["input_tokens"] + usage["cache_read_input_tokens"] == \
        ref["usage"]["prompt_tokens"]
    assert usage["output_tokens"] == ref["usage"]["completion_tokens"] == 8
    assert msg["stop_reason"] == "max_tokens"


def test_sdk_create_and_stream_agree(base_url):
    client = sdk(base_url)
    kwargs = dict(model=MODEL, system=SYSTEM, messages=USER, max_tokens=10)
    whole = client.messages.create(**kwargs, extra_body=GREEDY)
    with client.messages.stream(**kwargs, extra_body=GREEDY) as stream:
        texts = list(stream.text_stream)
        final = stream.get_final_message()
    assert "".join(texts) == whole.content[0].text == final.content[0].text
    assert final.stop_reason == whole.stop_reason == "max_tokens"
    assert final.usage.output_tokens == whole.usage.output_tokens == 10
    raw = events(base_url, {**kwargs, **GREEDY})
    got = assembled(raw)
    assert got["content"] == [b.model_dump(exclude_none=True) for b in whole.content]
    assert got["stop_reason"] == "max_tokens" and got["stop_sequence"] is None


def test_stop_sequences(base_url):
    client = sdk(base_url)
    kwargs = dict(model=MODEL, system=SYSTEM, messages=USER, max_tokens=12, extra_body=GREEDY)
    text = client.messages.create(**kwargs).content[0].text
    stop = text[len(text) // 2:len(text) // 2 + 2]
    assert len(stop) == 2, text
    msg = client.messages.create(**kwargs, stop_sequences=[stop])
    assert msg.stop_reason == "stop_sequence" and msg.stop_sequence == stop
    ref = chat(base_url, model=MODEL, messages=[{"role": "system", "content": SYSTEM}, *USER],
               max_tokens=12, temperature=0, stop=[stop])
    assert (msg.content[0].text if msg.content else "") == ref["choices"][0]["message"]["content"]
    with client.messages.stream(**kwargs, stop_sequences=[stop]) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == stop
    assert [b.text for b in final.content] == [b.text for b in msg.content]


def test_count_tokens_is_the_chat_prompt(base_url):
    client = sdk(base_url)
    history = [*USER, {"role": "assistant", "content": [{"type": "text", "text": "Hi."}]},
               {"role": "user", "content": [{"type": "text", "text": "Again."}]}]
    counted = client.messages.count_tokens(model=MODEL, system=SYSTEM, messages=history)
    ref = chat(base_url, model=MODEL, max_tokens=1, messages=[
        {"role": "system", "content": SYSTEM}, *USER, {"role": "assistant", "content": "Hi."},
        {"role": "user", "content": "Again."}])
    assert counted.input_tokens == ref["usage"]["prompt_tokens"]


BAD = [
    ({"messages": USER}, 400, "max_tokens"),
    ({"messages": [{"role": "system", "content": "x"}], "max_tokens": 4}, 400, "messages"),
    ({"messages": [], "max_tokens": 4}, 400, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "video"}]}], "max_tokens": 4}, 400,
     "messages.0.content.0"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result"}]}], "max_tokens": 4},
     400, "tool_use_id"),
    ({"messages": USER, "max_tokens": 4, "tool_choice": {"type": "sometimes"}}, 400,
     "tool_choice"),
    ({"messages": USER, "max_tokens": 4, "tools": [{"type": "web_search_20250305",
                                                     "name": "web_search"}]}, 400, "tools.0"),
    ({"messages": USER, "max_tokens": 4, "thinking": {"type": "enabled",
                                                      "budget_tokens": 4}}, 400, "thinking"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {
        "type": "base64", "media_type": "image/png", "data": "AAAA"}}]}], "max_tokens": 4},
     400, "image"),
    ({"messages": USER, "max_tokens": 4, "temperature": 1.5}, 400, "temperature"),
    ({"messages": USER, "max_tokens": 4, "stop_sequences": [""]}, 400, "stop_sequences"),
    ({"messages": USER, "max_tokens": 4, "tools": [TOOL]}, 400, "tools"),  # no tool format
    ({"model": "nope", "messages": USER, "max_tokens": 4}, 404, "nope"),
]


@pytest.mark.parametrize("body,status,mention", BAD)
def test_bad_requests_are_anthropic_errors(base_url, body, status, mention):
    got, _, out = post(base_url, "/v1/messages", {"model": MODEL, **body})
    assert got == status, out
    kind = "not_found_error" if status == 404 else "invalid_request_error"
    assert out == {"type": "error", "error": {"type": kind, "message": out["error"]["message"]}}
    ErrorResponse.model_validate(out, strict=True)
    assert mention in out["error"]["message"]


def test_an_error_mid_stream_is_an_error_event(base_url):
    """A request past its deadline (the `timeout` extension) after the stream started ends
    with an `error` event in Anthropic's shape; whole, it is a 408."""
    body = {"model": MODEL, "messages": USER, "max_tokens": 200, "ignore_eos": True,
            "timeout": 0.001}
    got, _, out = post(base_url, "/v1/messages", body)
    assert got == 408 and out["error"]["type"] == "timeout_error"
    ErrorResponse.model_validate(out, strict=True)
    evs = events(base_url, body)
    assert evs[0]["type"] == "message_start"
    assert evs[-1]["type"] == "error" and evs[-1]["error"]["type"] == "timeout_error"
    assert "timed out" in evs[-1]["error"]["message"]


def test_the_sdk_raises_its_errors(base_url):
    client = sdk(base_url)
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(model="nope", messages=USER, max_tokens=4)
    assert e.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError):
        client.messages.count_tokens(model=MODEL, messages=[])
    got, _, out = post(base_url, "/v1/messages", b"{not json")
    assert got == 400 and out["type"] == "error"
    got, _, out = post(base_url, "/v1/messages/nothing", {})
    assert got == 404 and out["error"]["type"] == "not_found_error"


# ---- the tool server: tool use and thinking ------------------------------------------------

@pytest.mark.parametrize("choice", [{"type": "auto", "disable_parallel_tool_use": True},
                                    {"type": "any"}, {"type": "none"}])
def test_tool_choices_are_accepted(tool_url, choice):
    msg = message(tool_url, model=TOOL_MODEL, messages=USER, tools=[TOOL], tool_choice=choice,
                  max_tokens=4, temperature=0)
    if choice["type"] == "none":
        assert all(b["type"] != "tool_use" for b in msg["content"])


@pytest.fixture(scope="module")
def tool_url(tool_server) -> str:
    return tool_server.url


def test_a_tool_history_renders_as_chat_does(tool_url):
    """tool_use blocks become tool calls, tool_result blocks tool messages: the same prompt
    as the OpenAI history."""
    history = [*USER,
               {"role": "assistant", "content": [
                   {"type": "text", "text": "Let me look."},
                   {"type": "tool_use", "id": "call_1", "name": "get_weather",
                    "input": {"city": "Paris"}}]},
               {"role": "user", "content": [
                   {"type": "tool_result", "tool_use_id": "call_1", "content": "sunny"}]}]
    counted = sdk(tool_url).messages.count_tokens(model=TOOL_MODEL, messages=history,
                                                  tools=[TOOL])
    ref = chat(tool_url, model=TOOL_MODEL, max_tokens=1, tools=[OPENAI_TOOL], messages=[
        *USER, {"role": "assistant", "content": "Let me look.", "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}])
    assert counted.input_tokens == ref["usage"]["prompt_tokens"]


def test_forced_tool_use_round_trip(tool_url):
    """A named tool choice calls the tool (a tool_use block whose input validates); its
    result goes back in the next request; the stream makes the same message."""
    import jsonschema
    client = sdk(tool_url)
    called = 0
    for seed in range(6):  # seeds 2, 3 and 5 call it within 120 tokens
        if called == 2:
            break
        kwargs = dict(model=TOOL_MODEL, messages=USER, tools=[TOOL], max_tokens=120,
                      tool_choice={"type": "tool", "name": "get_weather"},
                      extra_body={"seed": seed, "temperature": 1.0})
        msg = client.messages.create(**kwargs)
        if msg.stop_reason == "max_tokens":  # a random walk may ramble inside a string
            continue
        assert msg.stop_reason == "tool_use"
        uses = [b for b in msg.content if b.type == "tool_use"]
        assert uses and all(u.name == "get_weather" for u in uses)
        for u in uses:
            jsonschema.validate(u.input, TOOL["input_schema"])
        with client.messages.stream(**kwargs) as stream:
            final = stream.get_final_message()
        assert final.stop_reason == "tool_use"
        assert without_ids([b.model_dump() for b in final.content]) == \
            without_ids([b.model_dump() for b in msg.content])
        follow = client.messages.create(
            model=TOOL_MODEL, tools=[TOOL], max_tokens=4, extra_body=GREEDY, messages=[
                *USER, {"role": "assistant", "content": msg.content},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": u.id,
                                              "content": "sunny"} for u in uses]}])
        assert follow.usage.input_tokens + (follow.usage.cache_read_input_tokens or 0) > \
            msg.usage.input_tokens
        called += 1
    assert called >= 2


def test_auto_tool_answers_match_chat(tool_url):
    """Auto tool choice: the message's text and tool calls are chat's reading of the same
    greedy output, streamed or not."""
    msg = message(tool_url, model=TOOL_MODEL, messages=USER, tools=[TOOL], max_tokens=24,
                  temperature=0)
    ref = chat(tool_url, model=TOOL_MODEL, messages=USER, tools=[OPENAI_TOOL], max_tokens=24,
               temperature=0)["choices"][0]
    assert (text_of(msg) or None) == ref["message"]["content"]
    calls = [(b["name"], b["input"]) for b in msg["content"] if b["type"] == "tool_use"]
    assert calls == [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                     for c in ref["message"].get("tool_calls") or ()]
    got = assembled(events(tool_url, dict(model=TOOL_MODEL, messages=USER, tools=[TOOL],
                                          max_tokens=24, temperature=0)))
    assert without_ids(got["content"]) == without_ids(msg["content"])
    assert got["stop_reason"] == msg["stop_reason"]


def test_thinking_blocks_match_chat_reasoning(tool_url):
    body = dict(model=TOOL_MODEL, messages=USER, max_tokens=16, temperature=0,
                thinking={"type": "enabled", "budget_tokens": 4})
    msg = message(tool_url, **body)
    ref = chat(tool_url, model=TOOL_MODEL, messages=USER, max_tokens=16, temperature=0,
               enable_thinking=True, thinking_budget=4)["choices"][0]["message"]
    kinds = [b["type"] for b in msg["content"]]
    assert kinds[0] == "thinking" and "text" in kinds
    assert msg["content"][0]["thinking"] == ref["reasoning_content"]
    assert text_of(msg) == ref["content"]
    got = assembled(events(tool_url, body))
    assert got["content"] == msg["content"]
    sdk_body = {k: v for k, v in body.items() if k != "temperature"}
    with sdk(tool_url).messages.stream(**sdk_body, extra_body=GREEDY) as stream:
        final = stream.get_final_message()
    assert [b.model_dump(exclude_none=True) for b in final.content] == msg["content"]
    # earlier thinking sent back is accepted (as the chat's reasoning_content)
    message(tool_url, model=TOOL_MODEL, max_tokens=2, messages=[
        *USER, {"role": "assistant", "content": msg["content"]},
        {"role": "user", "content": "more"}])


# ---- API keys --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def keyed_url(server, tmp_path_factory):
    """A server with an API keys file, borrowing the shared server's runtime."""
    from serving.http.server import ServerThread
    path = tmp_path_factory.mktemp("anthropic-keys") / "keys.toml"
    path.write_text('[[keys]]\nkey = "sk-ant"\nname = "ant"\n')
    settings = dataclasses.replace(server.settings, api_keys_file=str(path))
    srv = ServerThread(settings, runtime=server.state.runtime).start()
    assert srv.wait_ready(timeout=60)
    wait_healthy(srv.url)
    yield srv.url
    srv.stop()


def test_x_api_key_and_401s(keyed_url):
    msg = sdk(keyed_url, "sk-ant").messages.create(model=MODEL, messages=USER, max_tokens=2)
    assert msg.usage.output_tokens == 2
    with pytest.raises(anthropic.AuthenticationError) as e:
        sdk(keyed_url, "sk-wrong").messages.create(model=MODEL, messages=USER, max_tokens=2)
    assert e.value.status_code == 401
    got, _, out = post(keyed_url, "/v1/messages", {"model": MODEL, "messages": USER,
                                                   "max_tokens": 2})
    assert got == 401 and out["type"] == "error"
    assert out["error"]["type"] == "authentication_error"
