"""The prefix cache over HTTP: `usage.prompt_tokens_details.cached_tokens`, `cache_salt`, the
counters in /metrics and the hit rate in /v1/metrale/stats, with the official client."""

from __future__ import annotations

import re

import numpy as np

from tests.serving.conftest import MODEL, get_json, post, sse_events

PS = 16


def _prompt(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, 400, n).tolist()


def _metric(base_url: str, name: str) -> float:
    import urllib.request
    with urllib.request.urlopen(base_url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    m = re.search(rf"^metrale:{name}(?:_total)? (\S+)$", text, re.M)
    assert m, f"{name} not in /metrics"
    return float(m.group(1))


def test_a_repeated_prompt_reports_its_cached_tokens(client, base_url, schemas):
    prompt = _prompt(1, 70)
    queries = _metric(base_url, "prefix_cache_queries")
    hits = _metric(base_url, "prefix_cache_hits")
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens == 64
    assert again.choices[0].text == first.choices[0].text
    status, _, body = post(base_url, "/v1/completions", {
        "model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0})
    assert status == 200 and body["usage"]["prompt_tokens_details"] == {"cached_tokens": 64}
    schemas.completion(body)
    assert _metric(base_url, "prefix_cache_queries") == queries + 210
    assert _metric(base_url, "prefix_cache_hits") == hits + 128
    stats = get_json(base_url, "/v1/metrale/stats")
    cache = stats["prefix_cache"]
    assert cache["enabled"] and cache["pages"] >= 4 and 0 < cache["hit_rate"] <= 1
    # every request has ended: no page is held by a sequence, the cached ones are idle
    assert cache["in_use_pages"] == 0 < cache["idle_pages"] <= cache["usable_pages"]
    assert stats["counters"]["prefix_cache_hits"] >= 64


def test_chat_usage_streamed_and_not(client, base_url, schemas):
    messages = [{"role": "system", "content": "You answer in one word. " * 4},
                {"role": "user", "content": "Which colour is the sky?"}]
    client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3)
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3)
    cached = out.usage.prompt_tokens_details.cached_tokens
    assert cached >= 64 and cached % PS == 0 and cached < out.usage.prompt_tokens
    events = sse_events(base_url, "/v1/chat/completions", {
        "model": MODEL, "messages": messages, "max_tokens": 3, "stream": True,
        "stream_options": {"include_usage": True}})
    last = [e for e in events if e != "[DONE]"][-1]
    assert last["usage"]["prompt_tokens_details"]["cached_tokens"] == cached
    schemas.chat_chunk(last)


def test_cache_salt_keeps_requests_apart(client):
    prompt = _prompt(2, 70)

    def cached(salt: str | None) -> int:
        extra = {"cache_salt": salt} if salt is not None else {}
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, extra_body=extra)
        return r.usage.prompt_tokens_details.cached_tokens

    assert cached("alpha") == 0
    assert cached(None) == 0  # the public namespace never sees a salted request's pages
    assert cached("beta") == 0
    assert cached("alpha") == 64
    assert cached("beta") == 64


def test_an_empty_cache_salt_is_a_400(base_url, schemas):
    for salt in ("", 5):
        status, _, body = post(base_url, "/v1/completions", {
            "model": MODEL, "prompt": "hi", "max_tokens": 2, "cache_salt": salt})
        assert status == 400
        schemas.error(body)
        assert body["error"]["param"] == "cache_salt"
