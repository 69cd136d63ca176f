"""Request dumps, `metrale replay` and per-tenant usage over real HTTP (Hypercorn on loopback).

A keyed server with `--dump-requests` borrows the shared tiny server's loaded runtime (nothing
loads or compiles again); its limiter reads a clock the tests hold still. A mixed run (ok,
streamed, 400, 401, 429, cancelled mid-stream, timed out) must leave exactly one dump line per
request, under the sequence number its answer carried, with the outcome the client saw; the
dump then replays against the same server with every greedy output reproduced.
"""

from __future__ import annotations

import dataclasses
import http.client
import json
import logging
import time
from pathlib import Path
from urllib.parse import urlparse

import numpy as np
import openai
import pytest

from serving.http.dumps import dump_files, read_dump_lines
from tests.serving.conftest import MODEL, post, run_main, wait_healthy
from tests.step_gate import gated

NOON = 1_767_225_600.0 + 12 * 3600  # 2026-01-01 12:00 UTC
KEYS = """
[[keys]]
key = "sk-a"
name = "a"
tenant = "acme"

[[keys]]
key = "sk-b"
name = "b"
tenant = "globex"

[[keys]]
key = "sk-rpm"
name = "rpm"
tenant = "initech"
requests_per_minute = 1

[[keys]]
key = "sk-admin"
name = "ops"
tenant = "ops"
admin = true
"""


@pytest.fixture(scope="module")
def dumped(server, tmp_path_factory):
    """(the ServerThread with keys and --dump-requests, its dump folder)."""
    from serving.http.server import ServerThread
    root = tmp_path_factory.mktemp("dumped")
    (root / "keys.toml").write_text(KEYS)
    folder = root / "dumps"
    settings = dataclasses.replace(server.settings, api_keys_file=str(root / "keys.toml"),
                                   dump_requests=str(folder))
    srv = ServerThread(settings, runtime=server.state.runtime).start()
    assert srv.wait_ready(timeout=60)
    wait_healthy(srv.url)
    srv.state.access.limiter.clock = lambda: NOON  # the rpm bucket never refills here
    yield srv, folder
    srv.stop()


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def ids(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, 250, n).tolist()


def lines_by_seq(srv, folder: Path, count: int, timeout: float = 60.0) -> dict[int, dict]:
    """The dump's lines by seq once `count` requests have been written (a stream's line is
    written just after its last byte, so the test waits for it)."""
    deadline = time.monotonic() + timeout
    while True:
        assert srv.state.dumper.flush()
        lines = [line for f in dump_files(folder) for line in read_dump_lines(f)]
        if len(lines) >= count or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    assert all(line is not None for line in lines)
    seqs = [line["seq"] for line in lines]
    assert len(seqs) == len(set(seqs)), "a request has more than one line"
    return {line["seq"]: line for line in lines}


def stream_and_leave(url: str, key: str, body: dict) -> int:
    """Opens a streamed chat answer, reads its first event, and leaves; returns its seq."""
    u = urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=120)
    conn.request("POST", "/v1/chat/completions", json.dumps({**body, "stream": True}),
                 {"Content-Type": "application/json", **auth(key)})
    resp = conn.getresponse()
    assert resp.status == 200
    seq = int(resp.getheader("x-request-seq"))
    assert resp.readline().startswith(b"data: ")  # the role delta: the stream has begun
    conn.sock.close()
    conn.close()
    return seq


def test_a_mixed_run_has_one_line_per_request_with_its_outcome(dumped, caplog):
    srv, folder = dumped
    url = srv.url
    before = len(lines_by_seq(srv, folder, 0, timeout=0))
    caplog.set_level(logging.INFO, logger="metrale.requests")
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi there"}],
            "max_tokens": 4, "temperature": 0}
    a = openai.OpenAI(base_url=url + "/v1", api_key="sk-a", max_retries=0, timeout=120)
    expected: dict[int, dict] = {}

    ok = a.chat.completions.with_raw_response.create(**chat)
    seq = int(ok.headers["x-request-seq"])
    body = ok.parse()
    expected[seq] = {"status": 200, "tenant": "acme", "usage": ok.http_response.json()["usage"],
                     "texts": [body.choices[0].message.content],
                     "finish_reasons": [body.choices[0].finish_reason]}

    with a.completions.with_streaming_response.create(
            model=MODEL, prompt=ids(1, 8), max_tokens=5, temperature=0, n=2, stream=True,
            stream_options={"include_usage": True}) as r:
        seq = int(r.headers["x-request-seq"])
        chunks = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: {")]
    texts, reasons = ["", ""], [None, None]
    for c in chunks:
        for ch in c["choices"]:
            texts[ch["index"]] += ch["text"]
            reasons[ch["index"]] = ch["finish_reason"] or reasons[ch["index"]]
    expected[seq] = {"status": 200, "tenant": "acme", "usage": chunks[-1]["usage"],
                     "texts": texts, "finish_reasons": reasons, "route": "/v1/completions"}

    status, headers, err = post(url, "/v1/chat/completions", {**chat, "max_tokens": -1},
                                auth("sk-b"))
    expected[int(headers["x-request-seq"])] = {"status": 400, "tenant": "globex",
                                               "code": err["error"]["code"]}
    status, headers, err = post(url, "/v1/chat/completions", chat, auth("sk-nobody"))
    expected[int(headers["x-request-seq"])] = {"status": 401, "tenant": None,
                                               "code": "invalid_api_key"}
    status, headers, _ = post(url, "/v1/chat/completions", chat, auth("sk-rpm"))
    expected[int(headers["x-request-seq"])] = {"status": 200, "tenant": "initech"}
    status, headers, err = post(url, "/v1/chat/completions", chat, auth("sk-rpm"))
    assert status == 429
    expected[int(headers["x-request-seq"])] = {"status": 429, "tenant": "initech",
                                               "code": "rate_limit_exceeded"}
    status, headers, err = post(url, "/v1/chat/completions", {**chat, "timeout": 1e-6},
                                auth("sk-b"))
    assert status == 408
    expected[int(headers["x-request-seq"])] = {"status": 408, "tenant": "globex",
                                               "code": "timeout", "timed_out": True}
    with gated(srv.state.runtime.scheduler.engine):  # no token before the client leaves
        seq = stream_and_leave(url, "sk-b", {**chat, "max_tokens": 50})
    expected[seq] = {"status": 200, "tenant": "globex", "cancelled": True}
    # probes are neither numbered nor dumped
    status, headers, _ = post(url, "/health", b"", method="GET")
    assert status == 200 and headers.get("x-request-seq") is None

    lines = lines_by_seq(srv, folder, before + len(expected))
    assert len(lines) == before + len(expected)
    for seq, want in expected.items():
        line = lines[seq]
        outcome = line["outcome"]
        assert line["route"] == want.get("route", "/v1/chat/completions"), line
        assert (line["status"], line["tenant"]) == (want["status"], want["tenant"]), line
        assert outcome["cancelled"] == want.get("cancelled", False), line
        assert outcome["timed_out"] == want.get("timed_out", False), line
        assert line["body"]["model"] == MODEL  # refused requests keep their body too
        if "code" in want:
            assert outcome["error"]["code"] == want["code"], line
        elif not want.get("cancelled"):
            assert outcome["error"] is None, line
        if "usage" in want:
            assert outcome["usage"] == want["usage"]
            assert outcome["texts"] == want["texts"]
            assert outcome["finish_reasons"] == want["finish_reasons"]
            t = line["timings"]
            assert 0 <= t["queue_s"] <= t["ttft_s"] <= t["total_s"], t
    logged = [r.getMessage() for r in caplog.records if r.name == "metrale.requests"]
    for seq in expected:
        assert sum(m.startswith(f"#{seq} ") for m in logged) == 1
    assert not any("sk-" in m for m in logged)


def test_the_dump_replays_with_every_greedy_output_reproduced(dumped, capsys):
    """`metrale replay` sends the dump's requests to the same server: the greedy and seeded
    ones (chat and completions, streamed or not, n > 1) compare equal."""
    srv, folder = dumped
    a = openai.OpenAI(base_url=srv.url + "/v1", api_key="sk-a", max_retries=0, timeout=120)
    a.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "a b c"}],
                              max_tokens=6, temperature=0)
    a.completions.create(model=MODEL, prompt=ids(5, 12), max_tokens=6, temperature=0.8,
                         seed=7, n=2)
    list(a.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                   max_tokens=5, temperature=0, stream=True))
    a.completions.create(model=MODEL, prompt="echo me", max_tokens=3, temperature=0, echo=True)
    srv.state.dumper.flush()
    code, out, err = run_main(capsys, "replay", str(folder), "--url", srv.url, "--api-key",
                              "sk-admin", "--show-diffs")
    assert code == 0, out + err
    lines = out.splitlines()  # the title, the counts' header, the counts
    counts = dict(zip(lines[1].split(), map(int, lines[2].split()), strict=True))
    assert counts["replayed"] >= 4 and counts["replayed"] == counts["same"], out


def test_usage_per_tenant_in_metrics_and_the_usage_route(dumped):
    srv, _ = dumped
    url = srv.url

    def usage(query: str = "", key: str = "sk-admin"):
        return post(url, "/v1/metrale/usage" + query, b"", auth(key), method="GET")

    _, _, before = usage("?tenant=globex")
    b = openai.OpenAI(base_url=url + "/v1", api_key="sk-b", max_retries=0, timeout=120)
    prompt = ids(21, 150)
    outs = [b.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0)
            for _ in range(2)]
    status, _, after = usage("?tenant=globex")
    assert status == 200 and [t["tenant"] for t in after["data"]] == ["globex"]
    was, now = before["data"][0], after["data"][0]
    assert now["requests"] - was["requests"] == 2
    assert now["prompt_tokens"] - was["prompt_tokens"] == sum(o.usage.prompt_tokens
                                                              for o in outs)
    assert now["completion_tokens"] - was["completion_tokens"] == 6
    assert now["cached_tokens"] - was["cached_tokens"] == sum(
        o.usage.prompt_tokens_details.cached_tokens for o in outs) > 0
    # since: a time after these requests' minute counts none of them
    future = time.time() + 120
    _, _, later = usage(f"?tenant=globex&since={future}")
    assert later["data"][0]["requests"] == 0
    _, _, recent = usage("?since=" + time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                   time.gmtime(time.time() - 60)))
    names = {t["tenant"] for t in recent["data"]}
    assert {"acme", "globex", "initech", "ops"} <= names
    # Prometheus: per tenant, with the limit that refused (1 request a minute, clock held)
    for _ in range(2):
        post(url, "/v1/chat/completions", {"model": MODEL, "messages": [
            {"role": "user", "content": "x"}], "max_tokens": 1}, auth("sk-rpm"))
    text = srv.state.metrics.render().decode()
    assert 'metrale:tenant_requests_total{tenant="globex"}' in text
    assert 'metrale:tenant_rejected_requests_total{limit="requests",tenant="initech"}' in text
    cached = [line for line in text.splitlines()
              if line.startswith('metrale:tenant_cached_prompt_tokens_total{tenant="globex"}')]
    assert cached and float(cached[0].split()[-1]) >= now["cached_tokens"]
    # errors
    assert usage(key="sk-b")[0] == 403  # not an admin
    assert usage("?tenant=nobody")[2]["error"]["code"] == "tenant_not_found"
    status, _, err = usage("?since=yesterday")
    assert status == 400 and err["error"]["param"] == "since"


def test_a_full_disk_never_fails_a_request(server, tmp_path, caplog):
    """Dump writes failing (ENOSPC, /dev/full) disable dumping with one error log; requests
    go on, still numbered."""
    if not Path("/dev/full").exists():
        pytest.skip("needs Linux's /dev/full")
    from serving.http.server import ServerThread
    folder = tmp_path / "dumps"
    folder.mkdir()
    (folder / "requests-1.jsonl").symlink_to("/dev/full")
    settings = dataclasses.replace(server.settings, dump_requests=str(folder))
    srv = ServerThread(settings, runtime=server.state.runtime).start()
    try:
        assert srv.wait_ready(timeout=60)
        caplog.set_level(logging.ERROR, logger="serving.http.dumps")
        body = {"model": MODEL, "prompt": ids(2, 4), "max_tokens": 2, "temperature": 0}
        answers = [post(srv.url, "/v1/completions", body) for _ in range(3)]
        assert [a[0] for a in answers] == [200] * 3
        assert [int(a[1]["x-request-seq"]) for a in answers] == [1, 2, 3]
        srv.state.dumper.flush()
        assert not srv.state.dumper.enabled
        errors = [r for r in caplog.records if r.name == "serving.http.dumps"]
        assert len(errors) == 1 and "disabled" in errors[0].getMessage()
    finally:
        srv.stop()


def test_the_keyless_server_counts_anonymous_usage(base_url):
    post(base_url, "/v1/completions", {"model": MODEL, "prompt": ids(3, 4), "max_tokens": 1,
                                       "temperature": 0})
    status, _, body = post(base_url, "/v1/metrale/usage?tenant=anonymous", b"", method="GET")
    assert status == 200 and body["data"][0]["requests"] >= 1
