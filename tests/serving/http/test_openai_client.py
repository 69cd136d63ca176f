"""The official openai client, sync and async, against the real server (tiny random model)."""

from __future__ import annotations

import asyncio

import pytest

from tests.serving.conftest import MODEL, post

MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]


def test_models(client, schemas, base_url):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    status, _, body = post(base_url, "/v1/models", b"", method="GET")
    assert status == 200
    schemas.validate("ListModelsResponse", body)
    status, _, body = post(base_url, f"/v1/models/{MODEL}", b"", method="GET")
    schemas.validate("Model", body)
    status, _, body = post(base_url, "/v1/models/nope", b"", method="GET")
    assert status == 404
    schemas.error(body)


def test_chat(client, base_url, tokenizer):
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8,
                                       temperature=0)
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion"
    assert r.model == MODEL and r.system_fingerprint
    choice = r.choices[0]
    assert choice.index == 0 and choice.message.role == "assistant"
    assert choice.finish_reason in ("stop", "length")
    # usage equals the tokenizer's count of the rendered prompt
    status, _, tok = post(base_url, "/tokenize", {"model": MODEL, "messages": MESSAGES})
    assert status == 200
    assert r.usage.prompt_tokens == tok["count"]
    assert 1 <= r.usage.completion_tokens <= 8
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_completion_prompt_forms(client, tokenizer):
    ids = tokenizer.encode("the cat", add_special_tokens=True)
    r = client.completions.create(model=MODEL, prompt="the cat", max_tokens=5, temperature=0)
    assert r.id.startswith("cmpl-") and r.object == "text_completion"
    assert r.usage.prompt_tokens == len(ids)
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=5, temperature=0)
    assert by_ids.choices[0].text == r.choices[0].text
    many = client.completions.create(model=MODEL, prompt=["the cat", "a dog"], max_tokens=4,
                                     temperature=0)
    assert [c.index for c in many.choices] == [0, 1]
    assert many.choices[0].text == client.completions.create(
        model=MODEL, prompt="the cat", max_tokens=4, temperature=0).choices[0].text
    lists = client.completions.create(model=MODEL, prompt=[ids, ids[:2]], max_tokens=3,
                                      temperature=0)
    assert len(lists.choices) == 2
    assert lists.usage.prompt_tokens == len(ids) + 2


def test_completion_echo(client):
    r = client.completions.create(model=MODEL, prompt="the cat", max_tokens=4, temperature=0,
                                  echo=True)
    plain = client.completions.create(model=MODEL, prompt="the cat", max_tokens=4,
                                      temperature=0)
    assert r.choices[0].text == "the cat" + plain.choices[0].text


def test_n_choices(client):
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6, n=2,
                                       temperature=1.0, seed=3)
    assert [c.index for c in r.choices] == [0, 1]
    stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6, n=2,
                                            temperature=1.0, seed=3, stream=True)
    texts, finished = {0: "", 1: ""}, set()
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            if c.finish_reason:
                finished.add(c.index)
    assert finished == {0, 1}
    assert texts == {c.index: c.message.content for c in r.choices}


def test_seeded_reproducible(client):
    kw = dict(model=MODEL, prompt="once upon", max_tokens=12, temperature=1.0, top_p=0.9,
              seed=1234)
    a = client.completions.create(**kw).choices[0].text
    b = client.completions.create(**kw).choices[0].text
    assert a == b


def test_stop_string(client):
    base = client.completions.create(model=MODEL, prompt="the cat", max_tokens=16,
                                     temperature=0, extra_body={"ignore_eos": True}).choices[0].text
    stop = next((base[i:i + 2] for i in range(2, len(base) - 2) if base[i:i + 2].strip()), None)
    if stop is None:
        pytest.skip("the random model produced no usable stop string")
    r = client.completions.create(model=MODEL, prompt="the cat", max_tokens=16, temperature=0,
                                  stop=[stop], extra_body={"ignore_eos": True})
    c = r.choices[0]
    assert c.finish_reason == "stop"
    assert c.text == base[:base.index(stop)]
    assert stop not in c.text


def test_logprobs(client):
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5,
                                       temperature=0, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.logprob <= 0
        # greedy: the sampled token is the most likely one
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob, abs=1e-4)
    c = client.completions.create(model=MODEL, prompt="hi", max_tokens=4, temperature=0,
                                  logprobs=2)
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert all(len(t) <= 2 for t in lp.top_logprobs)


def test_stream_include_usage(client):
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    finals = [c for c in chunks[:-1] if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0] is chunks[-2]
    text = "".join(c.choices[0].delta.content or "" for c in chunks[:-1])
    full = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6,
                                          temperature=0)
    assert text == full.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    comp = list(client.completions.create(model=MODEL, prompt="hi", max_tokens=4,
                                          temperature=0, stream=True,
                                          stream_options={"include_usage": True}))
    assert comp[-1].choices == [] and comp[-1].usage.completion_tokens == 4


def test_async_client(async_client_factory):
    async def main():
        client = async_client_factory()
        r = await client.chat.completions.create(model=MODEL, messages=MESSAGES,
                                                 max_tokens=5, temperature=0)
        stream = await client.completions.create(model=MODEL, prompt="hi", max_tokens=5,
                                                 temperature=0, stream=True)
        text = "".join([c.choices[0].text async for c in stream if c.choices])
        plain = await client.completions.create(model=MODEL, prompt="hi", max_tokens=5,
                                                temperature=0)
        await client.close()
        return r, text, plain

    r, text, plain = asyncio.run(main())
    assert r.choices[0].message.role == "assistant"
    assert text == plain.choices[0].text


def test_content_parts(client):
    text = client.chat.completions.create(
        model=MODEL, max_tokens=4, temperature=0,
        messages=[{"role": "user", "content": [{"type": "text", "text": "hel"},
                                               {"type": "text", "text": "lo"}]}])
    plain = client.chat.completions.create(
        model=MODEL, max_tokens=4, temperature=0,
        messages=[{"role": "user", "content": "hello"}])
    assert text.choices[0].message.content == plain.choices[0].message.content
