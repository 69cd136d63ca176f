"""API keys, tenants, rate limits and CORS over real HTTP (Hypercorn on a loopback port).

One keyed server (`--api-keys` file, `--allowed-origins`) borrows the shared tiny server's
loaded runtime, so nothing loads or compiles again; its limiter reads a clock the tests
advance (no sleeps). Each limit has its own key, so the tests do not share a bucket. The
official `openai` client is among the clients. Reloading the file on SIGHUP while a stream
is in flight runs against a `metrale serve` subprocess (tests/serving/cli/test_serve.py);
here the in-process server's reload handler (`ServerThread.reload_keys`, what SIGHUP calls)
is called directly.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import logging
import time

import numpy as np
import openai
import pytest

from tests.serving.conftest import MODEL, post, sse_events, wait_healthy
from tests.step_gate import gated

ORIGIN = "https://app.example"
NOON = 1_767_225_600.0 + 12 * 3600  # 2026-01-01 12:00 UTC
KEYS = f"""
[[keys]]
key = "sk-alice"
name = "alice"
tenant = "acme"

[[keys]]
key_sha256 = "{hashlib.sha256(b"sk-hashed").hexdigest()}"
name = "hashed"
tenant = "acme"

[[keys]]
key = "sk-off"
name = "off"
enabled = false

[[keys]]
key = "sk-admin"
name = "ops"
tenant = "ops"
admin = true

[[keys]]
key = "sk-bob"
name = "bob"
tenant = "globex"

[[keys]]
key = "sk-blind"
name = "blind"
tenant = "acme"
models = ["another-model"]

[[keys]]
key = "sk-rpm"
name = "rpm"
tenant = "r"
requests_per_minute = 3

[[keys]]
key = "sk-tpm"
name = "tpm"
tenant = "t"
tokens_per_minute = 200

[[keys]]
key = "sk-daily"
name = "daily"
tenant = "d"
daily_tokens = 100

[[keys]]
key = "sk-conc"
name = "conc"
tenant = "c"
max_concurrent_requests = 4

[tenants.c]
max_concurrent = 2
"""


class Clock:
    """The keyed server's limiter clock (seconds since the epoch), advanced by the tests."""

    def __init__(self):
        self.t = NOON

    def __call__(self) -> float:
        return self.t


@pytest.fixture(scope="module")
def keyed(server, tmp_path_factory):
    """(the keyed ServerThread, its clock, its keys file)."""
    from serving.http.server import ServerThread
    path = tmp_path_factory.mktemp("keys") / "keys.toml"
    path.write_text(KEYS)
    settings = dataclasses.replace(server.settings, api_keys_file=str(path),
                                   allowed_origins=(ORIGIN,))
    srv = ServerThread(settings, runtime=server.state.runtime).start()
    assert srv.wait_ready(timeout=60)
    wait_healthy(srv.url)
    clock = Clock()
    srv.state.access.limiter.clock = clock
    yield srv, clock, path
    srv.stop()
    assert server.state.runtime.ready  # a borrowed runtime outlives its borrower


@pytest.fixture(scope="module")
def url(keyed) -> str:
    return keyed[0].url


def client(url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=120)


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def ids(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, 250, n).tolist()


def complete(url: str, key: str, prompt: list[int], max_tokens: int, **extra):
    return post(url, "/v1/completions", {"model": MODEL, "prompt": prompt,
                                         "max_tokens": max_tokens, "temperature": 0, **extra},
                auth(key))


# ---- keys --------------------------------------------------------------------------------
def test_valid_unknown_disabled_and_hashed_keys(url, schemas):
    models = client(url, "sk-alice").models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert client(url, "sk-hashed").models.list().data[0].id == MODEL  # stored as its sha256
    for key in ("sk-nobody", "sk-off"):
        with pytest.raises(openai.AuthenticationError) as e:
            client(url, key).models.list()
        assert e.value.status_code == 401 and e.value.code == "invalid_api_key"
    for headers in ({}, {"Authorization": "sk-alice"}, {"Authorization": "Basic sk-alice"}):
        status, h, body = post(url, "/v1/models", b"", headers, method="GET")
        assert status == 401 and h.get("x-request-id"), body
        schemas.error(body)
        assert body["error"]["code"] == "invalid_api_key"
    for path in ("/tokenize", "/lora-adapters", "/v1/nothing"):  # every route but two
        assert post(url, path, {"prompt": "hi"}, method="POST")[0] == 401
    import urllib.request
    for path in ("/health", "/metrics"):  # open
        with urllib.request.urlopen(url + path, timeout=30) as r:
            assert r.status == 200


def test_admin_routes_need_an_admin_key_and_show_tenants_never_keys(url, schemas):
    for key in ("sk-alice", "sk-bob"):
        status, _, body = post(url, "/v1/metrale/stats", b"", auth(key), method="GET")
        assert status == 403 and body["error"]["type"] == "permission_error", body
        schemas.error(body)
        status, _, body = post(url, "/lora-adapters", [], auth(key))
        assert status == 403, body
        status, _, body = post(url, "/v1/unload_lora_adapter", {"lora_name": "x"}, auth(key))
        assert status == 403, body
    assert post(url, "/lora-adapters", b"", auth("sk-alice"), method="GET")[0] == 200
    status, _, stats = post(url, "/v1/metrale/stats", b"", auth("sk-admin"), method="GET")
    assert status == 200
    tenants = stats["tenants"]
    assert set(tenants) == {"acme", "default", "globex", "ops", "r", "t", "d", "c"}
    assert tenants["acme"] == {"keys": 3, "enabled_keys": 3, "max_concurrent": None,
                               "running": 0, "waiting": 0}
    assert tenants["c"]["max_concurrent"] == 2 and tenants["default"]["enabled_keys"] == 0
    text = json.dumps(stats)
    assert "sk-" not in text and hashlib.sha256(b"sk-hashed").hexdigest()[:16] not in text


def test_protect_metrics_and_the_single_api_key(server):
    """`--api-key` alone: one admin key; with --protect-metrics /metrics needs it too."""
    import urllib.error
    import urllib.request

    from serving.http.server import ServerThread
    settings = dataclasses.replace(server.settings, api_key="sk-single",
                                   protect_metrics=True)
    srv = ServerThread(settings, runtime=server.state.runtime).start()
    try:
        assert srv.wait_ready(timeout=60)
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(srv.url + "/metrics", timeout=30)
        assert e.value.code == 401
        req = urllib.request.Request(srv.url + "/metrics", headers=auth("sk-single"))
        with urllib.request.urlopen(req, timeout=30) as r:
            assert r.status == 200 and b"metrale:" in r.read()
        with urllib.request.urlopen(srv.url + "/health", timeout=30) as r:
            assert r.status == 200
        status, _, stats = post(srv.url, "/v1/metrale/stats", b"", auth("sk-single"),
                                method="GET")
        assert status == 200 and stats["tenants"]["default"]["keys"] == 1  # admin
        assert srv.reload_keys() is False  # no file to read again
    finally:
        srv.stop()


def test_a_model_the_key_may_not_use_is_answered_as_absent(url):
    blind = client(url, "sk-blind")
    assert blind.models.list().data == []
    with pytest.raises(openai.NotFoundError) as e:
        blind.chat.completions.create(model=MODEL, max_tokens=2,
                                      messages=[{"role": "user", "content": "hi"}])
    assert e.value.code == "model_not_found" and e.value.param == "model"
    assert MODEL in e.value.message and "may use none of this server's models" in \
        e.value.message
    for path, body in (("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
                       ("/tokenize", {"prompt": "hi"})):
        status, _, out = post(url, path, body, auth("sk-blind"))  # model omitted: the base
        assert status == 404 and out["error"]["code"] == "model_not_found", out
    status, _, _ = post(url, f"/v1/models/{MODEL}", b"", auth("sk-blind"), method="GET")
    assert status == 404
    status, _, unknown = post(url, "/v1/completions", {"model": "gpt-9", "prompt": "hi"},
                              auth("sk-alice"))
    assert status == 404 and unknown["error"]["code"] == "model_not_found"


def test_a_bad_file_on_reload_keeps_the_keys_and_logs_one_error(keyed, url, caplog):
    srv, _, path = keyed
    path.write_text(KEYS.replace('name = "bob"', 'name = "bob"\ncolour = "red"'))
    with caplog.at_level(logging.ERROR, logger="serving.http.access"):
        assert srv.reload_keys() is False
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "keeping the 10 keys in use" in errors[0].getMessage()
    assert "colour" in errors[0].getMessage() and "sk-" not in errors[0].getMessage()
    assert post(url, "/v1/models", b"", auth("sk-bob"), method="GET")[0] == 200
    path.write_text(KEYS.replace('key = "sk-bob"', 'key = "sk-bob2"'))
    try:
        assert srv.reload_keys() is True
        assert post(url, "/v1/models", b"", auth("sk-bob"), method="GET")[0] == 401
        assert post(url, "/v1/models", b"", auth("sk-bob2"), method="GET")[0] == 200
    finally:
        path.write_text(KEYS)
        assert srv.reload_keys() is True
    assert post(url, "/v1/models", b"", auth("sk-bob"), method="GET")[0] == 200


def test_the_end_hook_sees_each_request_once_with_its_usage(keyed, url):
    """`Access.end_hooks` (where request dumps and usage counters hook in) get every
    request's finished context exactly once: tenant, key name, route, actual usage."""
    srv = keyed[0]
    seen = []
    srv.state.access.end_hooks.append(seen.append)
    try:
        body = {"model": MODEL, "prompt": ids(3, 5), "max_tokens": 3, "temperature": 0,
                "ignore_eos": True}
        _, h1, plain = post(url, "/v1/completions", body, auth("sk-bob"))
        events = sse_events(url, "/v1/completions", {**body, "stream": True,
                                                     "stream_options": {"include_usage": True}},
                            auth("sk-bob"))
        _, h3, _ = post(url, "/v1/completions", {**body, "max_tokens": -1}, auth("sk-bob"))
        _, h4, _ = post(url, "/v1/models", b"", auth("sk-nobody"), method="GET")
        _, h5, _ = post(url, "/health", b"", method="GET")
        deadline = time.monotonic() + 30  # (a stream ends just after its last byte is sent)
        while len(seen) < 5 and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        srv.state.access.end_hooks.remove(seen.append)
    by_id = {c.request_id: c for c in seen}
    assert len(by_id) == 5 and all(c.finished and c.seq is None for c in seen)
    ok = by_id[h1["x-request-id"]]
    assert (ok.tenant, ok.key_name, ok.method, ok.path) == ("globex", "bob", "POST",
                                                            "/v1/completions")
    assert ok.usage == plain["usage"] and ok.usage["completion_tokens"] == 3
    stream = next(c for c in seen if c.deferred)
    assert stream.usage == events[-2]["usage"] and stream.tenant == "globex"
    assert by_id[h3["x-request-id"]].usage == {}  # a 400: no generation
    assert by_id[h4["x-request-id"]].key is None  # a 401
    assert by_id[h5["x-request-id"]].key is None and by_id[h5["x-request-id"]].path == "/health"


# ---- limits ------------------------------------------------------------------------------
def _rate(headers, kind: str) -> tuple[str, str, str]:
    return tuple(headers[f"x-ratelimit-{w}-{kind}"] for w in ("limit", "remaining", "reset"))


def test_requests_per_minute_trip_at_the_limit_and_recover(keyed, url, schemas):
    _, clock, _ = keyed
    seen = []
    for _ in range(3):
        status, headers, _ = post(url, "/v1/models", b"", auth("sk-rpm"), method="GET")
        assert status == 200
        seen.append(_rate(headers, "requests"))
        assert "x-ratelimit-limit-tokens" not in headers  # no token limit on this key
    assert seen == [("3", "2", "20s"), ("3", "1", "40s"), ("3", "0", "1m0s")]
    status, headers, body = post(url, "/v1/models", b"", auth("sk-rpm"), method="GET")
    assert status == 429, body
    schemas.error(body)
    assert body["error"]["code"] == "rate_limit_exceeded"
    assert "3 requests per minute" in body["error"]["message"]
    assert headers["Retry-After"] == "20" and headers["retry-after-ms"] == "20000"
    assert _rate(headers, "requests") == ("3", "0", "1m0s")
    with pytest.raises(openai.RateLimitError) as e:  # as the official client sees it
        client(url, "sk-rpm").models.list()
    assert e.value.status_code == 429 and e.value.code == "rate_limit_exceeded"
    clock.t += 20  # one request's worth refilled
    status, headers, _ = post(url, "/v1/models", b"", auth("sk-rpm"), method="GET")
    assert status == 200 and _rate(headers, "requests") == ("3", "0", "1m0s")
    assert post(url, "/v1/models", b"", auth("sk-rpm"), method="GET")[0] == 429
    clock.t += 60  # the whole window
    status, headers, _ = post(url, "/v1/models", b"", auth("sk-rpm"), method="GET")
    assert status == 200 and _rate(headers, "requests") == ("3", "2", "20s")


def _first_token(url: str, prompt: list[int]) -> int:
    """The prompt's first greedy token: as a stop token id, it ends the answer at once
    (whatever max_tokens says)."""
    status, _, out = complete(url, "sk-alice", prompt, 1, return_token_ids=True)
    assert status == 200, out
    return out["choices"][0]["token_ids"][0]


def test_tokens_per_minute_reserve_max_tokens_and_charge_actual_usage(keyed, url, schemas):
    """200 tokens per minute: a request reserves prompt + max_tokens at admission and is
    charged its actual usage at its end; the limit trips at exactly what is left."""
    _, clock, _ = keyed
    prompt = ids(7, 10)
    early = {"stop_token_ids": [_first_token(url, prompt)], "ignore_eos": True}
    status, headers, out = complete(url, "sk-tpm", prompt, 50, **early)
    assert status == 200, out
    used = out["usage"]["total_tokens"]
    assert used <= len(prompt) + 2 and out["choices"][0]["finish_reason"] == "stop"
    # charged 10 + answer, not the 60 reserved (settled before the answer's headers)
    assert _rate(headers, "tokens")[:2] == ("200", str(200 - used))
    events = sse_events(url, "/v1/completions", {
        "model": MODEL, "prompt": prompt, "max_tokens": 50, "temperature": 0, "stream": True,
        "stream_options": {"include_usage": True}, **early}, auth("sk-tpm"))
    assert events[-2]["usage"]["total_tokens"] == used
    status, headers, _ = post(url, "/v1/models", b"", auth("sk-tpm"), method="GET")
    left = 200 - 2 * used
    assert _rate(headers, "tokens")[:2] == ("200", str(left))  # the stream settled too
    # one token more than is left: 429; exactly what is left: admitted
    status, headers, body = complete(url, "sk-tpm", prompt, left - len(prompt) + 1, **early)
    assert status == 429, body
    schemas.error(body)
    assert body["error"]["code"] == "rate_limit_exceeded" and f"{left} are left" in \
        body["error"]["message"]
    assert headers["Retry-After"] == "1" and headers["retry-after-ms"] == "300"
    assert _rate(headers, "tokens")[1] == str(left)
    status, _, out = complete(url, "sk-tpm", prompt, left - len(prompt), **early)
    assert status == 200, out
    status, _, body = complete(url, "sk-tpm", prompt, 200)  # over the whole bucket
    assert status == 429 and "request too large" in body["error"]["message"]
    clock.t += 60
    status, headers, _ = post(url, "/v1/models", b"", auth("sk-tpm"), method="GET")
    assert _rate(headers, "tokens") == ("200", "200", "0s")


def test_the_daily_quota_ends_at_its_limit_and_resets_at_midnight(keyed, url):
    _, clock, _ = keyed
    prompt = ids(8, 10)
    status, _, out = complete(url, "sk-daily", prompt, 40,
                              stop_token_ids=[_first_token(url, prompt)], ignore_eos=True)
    assert status == 200 and out["usage"]["total_tokens"] <= 12, out
    left = 100 - out["usage"]["total_tokens"]
    status, headers, body = complete(url, "sk-daily", prompt, left - 10 + 1)
    assert status == 429 and f"{left} tokens left of its daily quota" in \
        body["error"]["message"]
    to_midnight = 86400 - clock.t % 86400  # (other tests moved the clock on from noon)
    assert headers["Retry-After"] == str(int(to_midnight))
    status, _, out = complete(url, "sk-daily", prompt, left - 10, ignore_eos=True)
    assert status == 200 and out["usage"]["total_tokens"] == left  # all of it, used
    status, headers, body = post(url, "/v1/models", b"", auth("sk-daily"), method="GET")
    assert status == 429 and "used its daily quota of 100" in body["error"]["message"]
    clock.t += to_midnight  # 00:00 UTC
    assert post(url, "/v1/models", b"", auth("sk-daily"), method="GET")[0] == 200


def test_concurrent_requests_under_32_parallel_clients(server, url):
    """Key limit 4 concurrent requests, tenant share 2 slots: with the engine held, 4 of 32
    parallel requests are accepted and the other 28 get 429 at once; of the 4, one
    admission round puts 2 in slots (the tenant's share) and 2 wait; then all 4 finish."""
    scheduler = server.state.runtime.scheduler

    def tenant_c() -> tuple[int, int]:
        snap = scheduler.snapshot()
        running = sum(1 for s in snap["slots"] if s and s["tenant"] == "c")
        return running, snap["waiting_by_tenant"].get("c", 0)

    async def main(gate) -> list:
        clients = [openai.AsyncOpenAI(base_url=url + "/v1", api_key="sk-conc", max_retries=0,
                                      timeout=120) for _ in range(32)]
        tasks = [asyncio.create_task(c.completions.create(
            model=MODEL, prompt=ids(100 + i, 6), max_tokens=3, temperature=0))
            for i, c in enumerate(clients)]
        while sum(t.done() for t in tasks) < 28:
            await asyncio.wait([t for t in tasks if not t.done()],
                               return_when=asyncio.FIRST_COMPLETED)
        while sum(tenant_c()) < 4:  # the 4 accepted reach the scheduler
            await asyncio.sleep(0.01)
        # The loop may still be on its way from the admission round to the step it is held in.
        assert await asyncio.to_thread(gate.entered.wait, 60), "the loop never stepped"
        await asyncio.to_thread(gate.next)  # one admission round
        shares = tenant_c()
        gate.open()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        for c in clients:
            await c.close()
        return [shares, results]

    with gated(scheduler.engine) as gate:
        shares, results = asyncio.run(main(gate))
    refused = [r for r in results if isinstance(r, openai.RateLimitError)]
    answered = [r for r in results if isinstance(r, openai.types.Completion)]
    assert len(refused) == 28 and len(answered) == 4, results
    assert all(r.code == "rate_limit_exceeded" and r.response.headers["Retry-After"] == "1"
               for r in refused)
    assert shares == (2, 2)
    assert post(url, "/v1/models", b"", auth("sk-conc"), method="GET")[0] == 200  # all freed


# ---- tenants, end to end -----------------------------------------------------------------
def test_tenants_never_share_cached_prompts(url):
    """The same long prompt: cached within a tenant (two keys of acme), never across."""
    prompt = ids(11, 150)

    def cached(key: str) -> int:
        out = client(url, key).completions.create(model=MODEL, prompt=prompt, max_tokens=2,
                                                  temperature=0)
        return out.usage.prompt_tokens_details.cached_tokens

    assert cached("sk-alice") == 0
    assert cached("sk-hashed") >= 128  # acme's other key: acme's pages
    assert cached("sk-bob") == 0  # globex finds none of acme's
    assert cached("sk-bob") >= 128
    assert cached("sk-admin") == 0  # ops


# ---- CORS --------------------------------------------------------------------------------
def _options(url: str, origin: str) -> tuple[int, dict]:
    import urllib.request
    req = urllib.request.Request(url + "/v1/chat/completions", method="OPTIONS", headers={
        "Origin": origin, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return r.status, r.headers


def test_cors_preflight_needs_no_key_and_only_allowed_origins_get_headers(url, base_url):
    status, headers = _options(url, ORIGIN)
    assert status == 200
    assert headers["Access-Control-Allow-Origin"] == ORIGIN
    assert "POST" in headers["Access-Control-Allow-Methods"]
    allowed = {h.strip().lower() for h in headers["Access-Control-Allow-Headers"].split(",")}
    assert {"authorization", "content-type"} <= allowed
    assert int(headers["Access-Control-Max-Age"]) == 600
    status, headers = _options(url, "https://evil.example")
    assert status == 200 and "Access-Control-Allow-Origin" not in headers
    status, headers = _options(base_url, ORIGIN)  # the shared server allows no origin
    assert "Access-Control-Allow-Origin" not in headers
    status, headers, _ = post(url, "/v1/models", b"", {"Origin": ORIGIN, **auth("sk-alice")},
                              method="GET")
    assert status == 200 and headers["Access-Control-Allow-Origin"] == ORIGIN
    exposed = {h.strip().lower() for h in headers["Access-Control-Expose-Headers"].split(",")}
    assert {"x-request-id", "retry-after", "x-ratelimit-remaining-requests"} <= exposed
    status, headers, _ = post(url, "/v1/models", b"", {"Origin": ORIGIN}, method="GET")
    assert status == 401 and headers["Access-Control-Allow-Origin"] == ORIGIN  # readable


def test_keys_never_reach_a_log_line_or_a_header(url, caplog):
    with caplog.at_level(logging.DEBUG):
        for key in ("sk-alice", "sk-nobody", "sk-off", "sk-hashed"):
            headers = post(url, "/v1/models", b"", auth(key), method="GET")[1]
            assert not any(key in v for v in headers.values())
        client(url, "sk-alice").completions.create(model=MODEL, prompt="hi", max_tokens=2)
    assert not [r for r in caplog.records if "sk-" in r.getMessage()]


# ---- flags ---------------------------------------------------------------------------------
@pytest.mark.parametrize("args, needle", [
    (["--api-keys", "{absent}"], "cannot read it"),
    (["--api-keys", "{bad}"], "keys[0]: unknown field(s) colour"),
    (["--api-key", " "], "--api-key must be"),
    (["--protect-metrics"], "--protect-metrics needs --api-key or --api-keys"),
    (["--allowed-origins", "https://app.example/path"], "no path"),
    (["--allowed-origins", "app.example"], "--allowed-origins 'app.example'"),
    (["--dump-redact"], "--dump-redact needs --dump-requests DIR"),
    (["--dump-requests", "{bad}"], "not a folder"),
    (["--dump-requests", "{tmp}", "--dump-file-mb", "0"], "--dump-file-mb must be > 0"),
    (["--usage-log", "{tmp}"], "--usage-log"),
])
def test_bad_access_flags_exit_2_before_the_model_loads(capsys, tmp_path, args, needle):
    from tests.serving.conftest import run_main
    bad = tmp_path / "bad.toml"
    bad.write_text('[[keys]]\nkey = "sk-x"\ncolour = "red"\n')
    args = [a.format(absent=tmp_path / "absent.toml", bad=bad, tmp=tmp_path) for a in args]
    code, _, err = run_main(capsys, "serve", "--model", str(tmp_path / "absent-model"),
                            "--port", "0", *args)
    assert code == 2, err
    assert err.startswith("metrale: error:") and needle in err, err
    assert "sk-x" not in err and "Traceback" not in err


def test_access_flags_reach_the_settings(tmp_path):
    from serving.cli import build_parser
    from serving.cli.serve import check_flags, server_settings
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"keys": [{"key": "sk-x", "tenant": "a"}]}))
    args = build_parser().parse_args([
        "serve", "--api-keys", str(keys), "--api-key", "sk-y", "--protect-metrics",
        "--allowed-origins", "https://a.example,http://localhost:3000", "*",
        "--dump-requests", str(tmp_path / "dumps"), "--dump-redact", "--dump-file-mb", "0.5",
        "--usage-log", str(tmp_path / "usage.jsonl")])
    check_flags(args)
    s = server_settings(args)
    assert s.usage_log == str(tmp_path / "usage.jsonl")
    assert (s.dump_requests, s.dump_redact, s.dump_file_bytes) == (
        str(tmp_path / "dumps"), True, 512 * 1024)
    assert (s.api_keys_file, s.api_key, s.protect_metrics) == (str(keys), "sk-y", True)
    assert s.allowed_origins == ("https://a.example", "http://localhost:3000", "*")
    from serving.http.access import read_keys
    ks = read_keys(s)
    assert ks.find("sk-x").tenant == "a" and ks.find("sk-y").admin
    plain_args = build_parser().parse_args(["serve"])
    check_flags(plain_args)
    plain = server_settings(plain_args)
    assert plain.api_keys_file is None and plain.allowed_origins == ()
    assert plain.dump_requests is None and not plain.dump_redact


def test_cors_preflight_allows_every_method_of_every_route(keyed):
    """Every (route, method) the app serves gets a preflight answer naming its method (a
    browser then sends it): DELETE /v1/responses/{id} among them."""
    import re
    import urllib.request
    srv = keyed[0]
    served = set()
    for rule in srv.app.url_map.iter_rules():
        path = re.sub(r"<[^>]*>", "x", rule.rule)
        for method in sorted(set(rule.methods or ()) - {"HEAD", "OPTIONS"}):
            served.add((path, method))
    assert ("/v1/responses/x", "DELETE") in served
    for path, method in sorted(served):
        req = urllib.request.Request(srv.url + path, method="OPTIONS", headers={
            "Origin": ORIGIN, "Access-Control-Request-Method": method,
            "Access-Control-Request-Headers": "authorization, content-type"})
        with urllib.request.urlopen(req, timeout=30) as r:
            assert r.status == 200, (path, method)
            assert r.headers["Access-Control-Allow-Origin"] == ORIGIN, (path, method)
            allowed = {m.strip() for m in r.headers["Access-Control-Allow-Methods"].split(",")}
            assert method in allowed, (path, method, allowed)
