"""The sampling controls end to end over HTTP, on the shared tiny server.

logit_bias forces and bans tokens; min_tokens holds off eos; DRY cuts repeated n-grams;
repetition_detection stops a looping greedy generation; return_token_ids gives vLLM's fields
(streamed too); seeded sampling with every control on is batch-invariant and compiles nothing;
bad values are 400s naming the parameter.
"""

from __future__ import annotations

import asyncio
import collections

import pytest

from tests.serving.conftest import MODEL, post, sse_events

PROMPT = [{"role": "user", "content": "Tell me a story about a cat."}]
ALL_ON = {"temperature": 0.9, "top_k": 60, "top_p": 0.95, "min_p": 0.01, "typical_p": 0.95,
          "top_n_sigma": 3.0, "xtc_threshold": 0.1, "xtc_probability": 0.5,
          "repetition_penalty": 1.1, "presence_penalty": 0.3, "frequency_penalty": 0.2,
          "dry_multiplier": 0.8, "lz_penalty": 0.1, "min_tokens": 3, "bad_words": ["the"],
          "logit_bias": {"7": 2.5, "9": -3.0}}


def chat(base_url: str, **fields) -> dict:
    status, _, body = post(base_url, "/v1/chat/completions",
                           {"model": MODEL, "messages": PROMPT, "return_token_ids": True,
                            **fields})
    assert status == 200, body
    return body


def ids_of(body: dict, i: int = 0) -> list[int]:
    return body["choices"][i]["token_ids"]


def test_logit_bias_forces_and_bans(base_url):
    forced = chat(base_url, logit_bias={"42": 100}, temperature=1.0, seed=1, max_tokens=6)
    assert ids_of(forced) == [42] * 6
    plain = ids_of(chat(base_url, temperature=0, max_tokens=8, ignore_eos=True))
    banned = ids_of(chat(base_url, temperature=0, max_tokens=8, ignore_eos=True,
                         logit_bias={str(plain[0]): -100}))
    assert plain[0] not in banned


def test_min_tokens_holds_off_eos(base_url, server):
    eos = server.state.runtime.eos_token_ids[0]
    bias = {str(eos): 100}  # greedy would end at once
    quick = chat(base_url, temperature=0, max_tokens=20, logit_bias=bias)
    assert ids_of(quick) == [eos] and quick["choices"][0]["finish_reason"] == "stop"
    held = chat(base_url, temperature=0, max_tokens=20, logit_bias=bias, min_tokens=5)
    ids = ids_of(held)
    assert eos not in ids[:5] and ids[5] == eos and len(ids) == 6
    assert held["choices"][0]["finish_reason"] == "stop"


def repeated_ngrams(ids: list[int], n: int = 3) -> int:
    """How many n-grams occur more than once (counting the extra occurrences)."""
    counts = collections.Counter(tuple(ids[i:i + n]) for i in range(len(ids) - n + 1))
    return sum(c - 1 for c in counts.values() if c > 1)


def test_dry_cuts_repeated_ngrams(base_url):
    story = "the cat sat on the mat. " * 6
    fields = {"temperature": 0, "max_tokens": 60, "ignore_eos": True,
              "messages": [{"role": "user", "content": story}]}
    plain = ids_of(chat(base_url, **fields))
    dry = ids_of(chat(base_url, dry_multiplier=3.0, dry_allowed_length=1, **fields))
    assert repeated_ngrams(plain) > 0, "the greedy baseline does not repeat: no signal"
    assert repeated_ngrams(dry) < repeated_ngrams(plain) / 2, (plain, dry)


def test_repetition_detection_stops_a_loop(base_url):
    fields = {"temperature": 0, "max_tokens": 120, "ignore_eos": True}
    plain = chat(base_url, **fields)
    ids = ids_of(plain)
    assert plain["choices"][0]["finish_reason"] == "length"
    stopped = chat(base_url, repetition_detection={"max_period": 16, "min_repeats": 3},
                   **fields)
    choice = stopped["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == "repetition"
    got = choice["token_ids"]
    assert got == ids[:len(got)] and len(got) < len(ids)
    # The tail it stopped on is one block repeated three times.
    assert any(got[-3 * p:] == got[-p:] * 3 for p in range(1, 17)), got


def test_return_token_ids_chat_and_stream(base_url, tokenizer, schemas):
    body = chat(base_url, temperature=0, max_tokens=12)
    schemas.chat(body)
    status, _, tok = post(base_url, "/tokenize", {"model": MODEL, "messages": PROMPT})
    assert status == 200 and body["prompt_token_ids"] == tok["tokens"]
    ids = ids_of(body)
    assert len(ids) == body["usage"]["completion_tokens"]
    assert tokenizer.decode(ids, skip_special_tokens=True) == body["choices"][0][
        "message"]["content"]
    events = sse_events(base_url, "/v1/chat/completions",
                        {"model": MODEL, "messages": PROMPT, "temperature": 0,
                         "max_tokens": 12, "stream": True, "return_token_ids": True})
    chunks = [e for e in events if e != "[DONE]"]
    for c in chunks:
        schemas.chat_chunk(c)
    assert chunks[0]["prompt_token_ids"] == tok["tokens"]
    streamed = [t for c in chunks for ch in c["choices"] for t in ch.get("token_ids", [])]
    assert streamed == ids


def test_return_token_ids_completions(base_url, schemas):
    req = {"model": MODEL, "prompt": [[11, 12], [5, 6, 7]], "max_tokens": 5,
           "temperature": 0, "return_token_ids": True}
    status, _, body = post(base_url, "/v1/completions", req)
    assert status == 200, body
    schemas.completion(body)
    assert body["choices"][1]["prompt_token_ids"] == [5, 6, 7]
    events = [e for e in sse_events(base_url, "/v1/completions", {**req, "stream": True})
              if e != "[DONE]"]
    for e in events:
        schemas.completion_chunk(e)
    for i in range(2):
        mine = [c for e in events for c in e["choices"] if c["index"] == i]
        assert mine[0]["prompt_token_ids"] == body["choices"][i]["prompt_token_ids"]
        assert [t for c in mine for t in c["token_ids"]] == body["choices"][i]["token_ids"]


def test_every_control_on_is_batch_invariant_and_compiles_nothing(server,
                                                                  async_client_factory):
    engine = server.state.runtime.scheduler.engine
    compiles = engine.compile_count

    async def main():
        client = async_client_factory()
        extras = {k: v for k, v in ALL_ON.items()
                  if k not in ("temperature", "top_p", "presence_penalty", "frequency_penalty",
                               "logit_bias")}
        fields = dict(temperature=ALL_ON["temperature"], top_p=ALL_ON["top_p"],
                      presence_penalty=ALL_ON["presence_penalty"],
                      frequency_penalty=ALL_ON["frequency_penalty"],
                      logit_bias=ALL_ON["logit_bias"])

        async def call(seed, more):
            r = await client.chat.completions.with_raw_response.create(
                model=MODEL, messages=PROMPT, max_tokens=24, seed=seed,
                extra_body={"return_token_ids": True, **extras, **more}, **fields)
            return r.http_response.json()["choices"][0]["token_ids"]

        alone = await call(7, {})
        others = [call(100 + i, {"dry_multiplier": 0.5 * i, "typical_p": 1.0,
                                 "top_k": 5 * i}) for i in range(7)]
        together = await asyncio.gather(call(7, {}), *others)
        await client.close()
        return alone, together[0]

    alone, together = asyncio.run(main())
    assert alone == together
    assert engine.compile_count == compiles


@pytest.mark.parametrize("field,value", [
    ("logit_bias", {"999999": 5}), ("logit_bias", {"abc": 1}), ("logit_bias", {"3": 101}),
    ("typical_p", 0), ("dry_base", 0.5), ("dry_penalty_last_n", -2), ("xtc_threshold", 1.5),
    ("repetition_penalty", 0), ("presence_penalty", 3), ("lz_penalty", -1),
    ("repetition_detection", {"max_period": 0}), ("repetition_detection", "yes"),
    ("bad_words", [""]), ("min_tokens", 50), ("top_n_sigma", "x"),
])
def test_bad_values_are_400_naming_the_parameter(base_url, schemas, field, value):
    status, _, body = post(base_url, "/v1/chat/completions",
                           {"model": MODEL, "messages": PROMPT, "max_tokens": 10,
                            field: value})
    assert status == 400, body
    schemas.error(body)
    assert body["error"]["param"].split(".")[0] == field, body
