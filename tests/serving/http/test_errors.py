"""Bad inputs get the right status and OpenAI's error shape; the server stays healthy."""

from __future__ import annotations

import pytest

from tests.serving.conftest import MAX_LEN, MODEL, post

MSG = [{"role": "user", "content": "hi"}]
CHAT = {"model": MODEL, "messages": MSG, "max_tokens": 4}

CASES = [
    ("invalid json", "/v1/chat/completions", b'{"model": ', 400, None),
    ("not an object", "/v1/chat/completions", b"[1, 2]", 400, None),
    ("wrong type", "/v1/chat/completions", {**CHAT, "max_tokens": "many"}, 400, "max_tokens"),
    ("messages not a list", "/v1/chat/completions", {**CHAT, "messages": "hi"}, 400,
     "messages"),
    ("negative max_tokens", "/v1/chat/completions", {**CHAT, "max_tokens": -1}, 400,
     "max_tokens"),
    ("temperature 5", "/v1/chat/completions", {**CHAT, "temperature": 5}, 400, "temperature"),
    ("top_logprobs 21", "/v1/chat/completions",
     {**CHAT, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    ("n 0", "/v1/chat/completions", {**CHAT, "n": 0}, 400, "n"),
    ("empty messages", "/v1/chat/completions", {**CHAT, "messages": []}, 400, "messages"),
    ("missing messages", "/v1/chat/completions", {"model": MODEL}, 400, "messages"),
    ("bad role", "/v1/chat/completions",
     {**CHAT, "messages": [{"role": "wizard", "content": "x"}]}, 400, "messages.0.role"),
    ("unknown model", "/v1/chat/completions", {**CHAT, "model": "gpt-9"}, 404, "model"),
    ("unknown model, completions", "/v1/completions",
     {"model": "gpt-9", "prompt": "hi", "max_tokens": 2}, 404, "model"),
    ("unknown model, tokenize", "/tokenize", {"model": "gpt-9", "prompt": "hi"}, 404, "model"),
    ("image part", "/v1/chat/completions",
     {**CHAT, "messages": [{"role": "user", "content": [
         {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}]}]},
     400, "messages[0].content[0]"),
    ("penalty out of range", "/v1/chat/completions", {**CHAT, "presence_penalty": 2.5},
     400, "presence_penalty"),
    ("logit_bias not a token id", "/v1/chat/completions", {**CHAT, "logit_bias": {"x": 5}},
     400, "logit_bias"),
    ("invalid json schema", "/v1/chat/completions",
     {**CHAT, "response_format": {"type": "json_schema", "json_schema": {
         "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "nope"}}}}}},
     400, "response_format"),
    ("two constraints", "/v1/chat/completions",
     {**CHAT, "response_format": {"type": "json_object"}, "regex": "a+"}, 400, "regex"),
    ("invalid regex", "/v1/chat/completions", {**CHAT, "regex": "(a"}, 400, "regex"),
    ("tools not implemented", "/v1/chat/completions",
     {**CHAT, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools"),
    ("prompt over the context", "/v1/completions",
     {"model": MODEL, "prompt": [5] * (MAX_LEN + 10), "max_tokens": 4}, 400, "prompt"),
    ("prompt plus max_tokens over", "/v1/completions",
     {"model": MODEL, "prompt": [5] * 10, "max_tokens": MAX_LEN}, 400, "prompt"),
    ("token id out of vocab", "/v1/completions",
     {"model": MODEL, "prompt": [10 ** 6], "max_tokens": 2}, 400, "prompt"),
    ("huge body", "/v1/completions", b'{"prompt": "' + b"x" * 300_000 + b'"}', 413, None),
    ("stream_options without stream", "/v1/completions",
     {"model": MODEL, "prompt": "x", "stream_options": {"include_usage": True}}, 400,
     "stream_options"),
]


@pytest.mark.parametrize(("name", "path", "body", "status", "param"), CASES,
                         ids=[c[0] for c in CASES])
def test_bad_input(base_url, schemas, name, path, body, status, param):
    got, headers, out = post(base_url, path, body)
    assert got == status, out
    schemas.error(out)
    assert out["error"]["message"]
    assert headers.get("x-request-id")
    if param is not None:
        assert out["error"]["param"] == param
    health, _, _ = post(base_url, "/health", b"", method="GET")
    assert health == 200


def test_context_length_message_states_both_numbers(base_url):
    _, _, out = post(base_url, "/v1/completions",
                     {"model": MODEL, "prompt": [5] * (MAX_LEN + 10), "max_tokens": 4})
    assert out["error"]["code"] == "context_length_exceeded"
    assert out["error"]["param"] == "prompt"
    assert str(MAX_LEN) in out["error"]["message"]
    assert str(MAX_LEN + 10) in out["error"]["message"]
    _, _, out = post(base_url, "/v1/chat/completions", {
        "model": MODEL, "max_tokens": MAX_LEN, "messages": [{"role": "user", "content": "hi"}]})
    assert out["error"]["code"] == "context_length_exceeded"
    assert out["error"]["param"] == "messages"


def test_404_and_405(base_url, schemas):
    status, headers, out = post(base_url, "/v1/nothing", {})
    assert status == 404 and headers.get("x-request-id")
    schemas.error(out)
    status, headers, out = post(base_url, "/v1/chat/completions", b"", method="GET")
    assert status == 405
    schemas.error(out)
    assert {m.strip() for m in headers["Allow"].split(",")} == {"OPTIONS", "POST"}
    status, headers, _ = post(base_url, "/v1/models", b"", method="POST")
    assert status == 405
    assert {m.strip() for m in headers["Allow"].split(",")} == {"GET", "HEAD", "OPTIONS"}


def test_unknown_model_is_404_model_not_found(client):
    """OpenAI's and vLLM's status and code (llama.cpp's server tests check both)."""
    import openai
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-9", messages=MSG, max_tokens=2)
    assert e.value.status_code == 404 and e.value.code == "model_not_found"
    assert f"serves {MODEL!r}" in e.value.message


def test_api_key(server, schemas):
    import asyncio
    import dataclasses

    from serving.http.app import create_app
    settings = dataclasses.replace(server.settings, api_key="sekrit")
    app = create_app(settings, server.state.runtime)  # shares the loaded model, not served

    async def main():
        c = app.test_client()
        no = await c.get("/v1/models")
        bad = await c.get("/v1/models", headers={"Authorization": "Bearer wrong"})
        ok = await c.get("/v1/models", headers={"Authorization": "Bearer sekrit"})
        health = await c.get("/health")
        return no, bad, ok, health, await no.get_json()

    no, bad, ok, health, body = asyncio.run(main())
    assert (no.status_code, bad.status_code, ok.status_code, health.status_code) == (
        401, 401, 200, 200)
    schemas.error(body)


def test_timeout(base_url, schemas):
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 200, "timeout": 0.001,
            "ignore_eos": True}
    status, _, out = post(base_url, "/v1/completions", body)
    assert status == 408 and out["error"]["code"] == "timeout"
    schemas.error(out)
    from tests.serving.conftest import sse_events
    events = sse_events(base_url, "/v1/completions", {**body, "stream": True})
    assert events[-1] == "[DONE]"
    assert events[-2]["error"]["code"] == "timeout"


def test_an_image_on_a_text_only_model(base_url, schemas):
    """An image part is a 400 naming it (the model takes no images), in chat and /tokenize;
    the card lists text as the only input."""
    messages = [{"role": "user", "content": [
        {"type": "text", "text": "what is this?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}]}]
    for path in ("/v1/chat/completions", "/tokenize"):
        status, _, out = post(base_url, path, {**CHAT, "messages": messages})
        assert status == 400, out
        schemas.error(out)
        assert out["error"]["param"] == "messages[0].content[1]"
        assert f"model {MODEL!r} takes no images" in out["error"]["message"]
    status, _, models = post(base_url, "/v1/models", b"", method="GET")
    assert status == 200 and models["data"][0]["input_modalities"] == ["text"]
    assert "max_images" not in models["data"][0]


@pytest.mark.parametrize("path, body, field", [
    ("/v1/chat/completions", {"messages": MSG, "source_lang": "eng_Latn"}, "source_lang"),
    ("/v1/completions", {"prompt": "Hello world", "tgt_lang": "fra_Latn"}, "tgt_lang"),
])
def test_languages_on_a_decoder_only_model_are_400(base_url, schemas, path, body, field):
    """Translation fields on this (decoder-only) model: 400 naming the field."""
    status, _, err = post(base_url, path, {"model": MODEL, "max_tokens": 2, **body})
    assert status == 400, err
    schemas.error(err)
    assert err["error"]["param"] == field
    assert "translation models" in err["error"]["message"]


LONE = "a\ud800b"  # a lone UTF-16 surrogate: JSON may escape one, no tokenizer can encode it
SURROGATES = [
    ("chat content", "/v1/chat/completions",
     {**CHAT, "messages": [{"role": "user", "content": LONE}]}, "messages[0].content"),
    ("chat content part", "/v1/chat/completions",
     {**CHAT, "messages": [MSG[0], {"role": "assistant", "content": "x"}, {
         "role": "user", "content": [{"type": "text", "text": LONE}]}]},
     "messages[2].content[0].text"),
    ("stop string", "/v1/chat/completions", {**CHAT, "stop": ["ok", LONE]}, "stop[1]"),
    ("completion prompt", "/v1/completions",
     {"model": MODEL, "prompt": LONE, "max_tokens": 2}, "prompt"),
    ("completion prompt list", "/v1/completions",
     {"model": MODEL, "prompt": ["hi", LONE], "max_tokens": 2}, "prompt[1]"),
    ("responses input", "/v1/responses",
     {"model": MODEL, "input": LONE, "max_output_tokens": 4}, "input"),
    ("tokenize", "/tokenize", {"model": MODEL, "prompt": LONE}, "prompt"),
    ("a key", "/v1/chat/completions", {**CHAT, "metadata": {LONE: "x"}}, "metadata"),
]


@pytest.mark.parametrize(("name", "path", "body", "param"), SURROGATES,
                         ids=[c[0] for c in SURROGATES])
def test_a_lone_surrogate_is_a_400_naming_its_field(base_url, schemas, name, path, body, param):
    """Text that is not Unicode (a lone surrogate, which JSON can escape) never reaches the
    tokenizer (whose TypeError was a 500): a 400 naming the field, and the server stays up."""
    got, _, out = post(base_url, path, body)
    assert got == 400, out
    schemas.error(out)
    assert out["error"]["param"] == param
    assert "surrogate" in out["error"]["message"] and "U+D800" in out["error"]["message"]
    health, _, _ = post(base_url, "/health", b"", method="GET")
    assert health == 200


def test_a_lone_surrogate_in_an_anthropic_message_is_its_400(base_url):
    got, _, out = post(base_url, "/v1/messages", {
        "model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": LONE}]})
    assert got == 400
    assert out["type"] == "error" and out["error"]["type"] == "invalid_request_error"
    assert "surrogate" in out["error"]["message"]


def test_a_paired_surrogate_is_one_character_and_served(base_url):
    """An escaped pair (`\\ud83d\\ude00`) is one valid character: served, not refused."""
    got, _, out = post(base_url, "/tokenize", b'{"model": "%s", "prompt": "\\ud83d\\ude00"}'
                       % MODEL.encode())
    assert got == 200, out
