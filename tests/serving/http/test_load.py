"""Concurrency, client disconnects and metrics against the real server."""

from __future__ import annotations

import asyncio
import http.client
import json
import time
import urllib.request
from urllib.parse import urlparse

from tests.serving.conftest import MODEL


def _metrics(base_url: str) -> dict[str, float]:
    with urllib.request.urlopen(base_url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def _wait_idle(base_url: str, timeout: float = 10.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = _metrics(base_url)
        if m["metrale:num_requests_running"] == 0 and m["metrale:requests_active"] == 0:
            return m
        assert time.monotonic() < deadline, m
        time.sleep(0.05)


def test_disconnect_mid_stream_frees_the_slot(base_url, server):
    u = urlparse(base_url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    body = {"model": MODEL, "prompt": "tell me", "max_tokens": 200, "ignore_eos": True,
            "stream": True}
    conn.request("POST", "/v1/completions", json.dumps(body),
                 {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    seen = 0
    for raw in resp:
        if raw.startswith(b"data: "):
            seen += 1
            if seen == 3:
                break
    m = _metrics(base_url)
    assert m["metrale:num_requests_running"] == 1
    resp.close()
    conn.close()
    m = _wait_idle(base_url)
    assert m["metrale:slots_used"] == 0
    assert all(s is None for s in server.state.runtime.scheduler.snapshot()["slots"])


def test_concurrent_streams_match_solo(async_client_factory, base_url):
    prompts = [f"story number {i}:" for i in range(32)]

    async def one(client, prompt):
        stream = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=12,
            temperature=0, stream=True)
        parts, finish = [], None
        async for chunk in stream:
            for c in chunk.choices:
                parts.append(c.delta.content or "")
                finish = c.finish_reason or finish
        assert finish in ("stop", "length")
        return "".join(parts)

    async def main():
        client = async_client_factory()
        together = await asyncio.gather(*(one(client, p) for p in prompts))
        alone = [await one(client, p) for p in prompts]
        await client.close()
        return together, alone

    together, alone = asyncio.run(main())
    assert len(together) == 32
    assert together == alone
    _wait_idle(base_url)


def test_metrics(base_url, client):
    before = _metrics(base_url)
    r = client.completions.create(model=MODEL, prompt="hi", max_tokens=3, temperature=0,
                                  extra_body={"ignore_eos": True})
    after = _wait_idle(base_url)
    assert after["metrale:slots_total"] == 8
    assert after["metrale:compiles_total"] >= 1
    key = 'metrale:request_success_total{finished_reason="length"}'
    assert after[key] == before.get(key, 0) + 1
    assert after["metrale:generation_tokens_total"] == (
        before["metrale:generation_tokens_total"] + r.usage.completion_tokens)
    assert after["metrale:prompt_tokens_total"] == (
        before["metrale:prompt_tokens_total"] + r.usage.prompt_tokens)
    for h in ("time_to_first_token_seconds", "time_per_output_token_seconds",
              "e2e_request_latency_seconds"):
        assert after[f"metrale:{h}_count"] > before.get(f"metrale:{h}_count", 0)
    assert after["metrale:num_requests_waiting"] == 0
    # Idle: every page back in the pool; no preemption with this server's pool.
    assert after["metrale:kv_cache_usage_perc"] == 0
    assert after["metrale:num_preemptions_total"] == 0
