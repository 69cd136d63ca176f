"""Constrained decoding over HTTP on the shared tiny random-weight server.

The model's own output is noise, so whatever parses was made to parse by the grammar masks:
for JSON schemas (nested objects, arrays, enums, bounded numbers, optional fields), regexes
and choices, every one of many seeds gives output that parses and validates; streamed output
equals non-streamed under the same seed; nothing compiles per request; constrained requests
run beside unconstrained ones.
"""

from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import pytest

from tests.serving.conftest import MODEL, post, sse_events

SCHEMAS = {
    "nested": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 12},
        "pet": {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]},
                                                 "age": {"type": "integer", "minimum": 0,
                                                         "maximum": 30}},
                "required": ["kind", "age"], "additionalProperties": False}},
        "required": ["name", "pet"], "additionalProperties": False},
    "array": {"type": "object", "properties": {
        "scores": {"type": "array", "items": {"type": "number", "minimum": -1, "maximum": 1},
                   "minItems": 1, "maxItems": 4},
        "ok": {"type": "boolean"}}, "required": ["scores"], "additionalProperties": False},
}
SEEDS = range(6)


def chat(base_url: str, **fields) -> dict:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Give me JSON."}],
            "max_tokens": 80, "temperature": 1.0, **fields}
    status, _, out = post(base_url, "/v1/chat/completions", body)
    assert status == 200, out
    return out


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_json_schema_output_validates_on_every_seed(base_url, schemas, name):
    fmt = {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name],
                                                  "strict": True}}
    for seed in SEEDS:
        body = chat(base_url, response_format=fmt, seed=seed)
        schemas.chat(body)
        choice = body["choices"][0]
        assert choice["finish_reason"] == "stop", choice
        jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMAS[name])


def test_json_object_mode(base_url):
    for seed in SEEDS:
        body = chat(base_url, response_format={"type": "json_object"}, seed=seed,
                    max_tokens=120)
        if body["choices"][0]["finish_reason"] == "stop":
            assert isinstance(json.loads(body["choices"][0]["message"]["content"]), dict)


@pytest.mark.parametrize("pattern", [r"[0-9]{3}-[a-z]{2,4}", r"(yes|no|maybe)!"])
def test_regex_output_matches_on_every_seed(base_url, pattern):
    for seed in SEEDS:
        text = chat(base_url, regex=pattern, seed=seed)["choices"][0]["message"]["content"]
        assert re.fullmatch(pattern, text), text


def test_choice_and_completions_endpoint(base_url):
    options = ["red", "green", "blue sky"]
    for seed in SEEDS:
        status, _, body = post(base_url, "/v1/completions",
                               {"model": MODEL, "prompt": "Colour:", "choice": options,
                                "seed": seed, "max_tokens": 10, "temperature": 1.0})
        assert status == 200, body
        assert body["choices"][0]["text"] in options


def test_stream_equals_non_stream_and_nothing_compiles(server, base_url):
    engine = server.state.runtime.scheduler.engine
    compiles = engine.compile_count
    fmt = {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMAS["nested"]}}
    whole = chat(base_url, response_format=fmt, seed=3)["choices"][0]["message"]["content"]
    events = sse_events(base_url, "/v1/chat/completions",
                        {"model": MODEL, "messages": [{"role": "user", "content": "Give me JSON."}],
                         "max_tokens": 80, "temperature": 1.0, "seed": 3, "stream": True,
                         "response_format": fmt})
    streamed = "".join(c["choices"][0]["delta"].get("content") or ""
                       for c in events if c != "[DONE]" and c["choices"])
    assert streamed == whole
    assert engine.compile_count == compiles


def test_constrained_beside_unconstrained(async_client_factory):
    async def main():
        client = async_client_factory()
        msgs = [{"role": "user", "content": "Hi"}]
        free = [client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=20,
                                               seed=i, temperature=1.0,
                                               extra_body={"ignore_eos": True})
                for i in range(4)]
        tied = [client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=20,
                                               seed=i, temperature=1.0,
                                               extra_body={"regex": "[ab]{3,8}"})
                for i in range(4)]
        out = await asyncio.gather(*free, *tied)
        await client.close()
        return out

    out = asyncio.run(main())
    assert all(r.usage.completion_tokens == 20 for r in out[:4])
    assert all(re.fullmatch("[ab]{3,8}", r.choices[0].message.content) for r in out[4:])
