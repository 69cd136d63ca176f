"""`metrale serve` (default `--warmup serve`) answers while the rest of its grid compiles in the
background, shows the progress in `/v1/metrale/stats`, and a server killed (SIGKILL) during
that compile, with a stream in flight, restarts cleanly from its persistent compilation cache
and stored programs (engine/executable_store.py), then completes the grid; its request dumps
up to the kill read back whole with `metrale replay`'s reader, and its usage log (`--usage-log`)
still counts the requests answered before the kill."""

from __future__ import annotations

import http.client
import json
import signal
import time
import urllib.request
from pathlib import Path

from serving.cli.replay import load_entries
from tests.serving.conftest import post, start_cli_server, stop_cli_server

BODY = {"model": "tiny", "prompt": "the quick brown fox", "max_tokens": 8, "temperature": 0,
        "ignore_eos": True}


def _stats(url: str) -> dict:
    with urllib.request.urlopen(url + "/v1/metrale/stats", timeout=30) as resp:
        return json.loads(resp.read())


def _serve(tiny_model, dumps: Path):
    return start_cli_server("--model", str(tiny_model), "--served-model-name", "tiny",
                            "--max-slots", "2", "--max-len", "128", "--max-prefill-len", "32",
                            "--dump-requests", str(dumps),
                            "--usage-log", str(dumps.parent / "usage.jsonl"))


def _completion_tokens(url: str, expected: int) -> int:
    """The anonymous tenant's generated tokens from the usage route, once they reach
    `expected` (a request's usage is recorded as it ends, just after its answer) or after 60 s."""
    deadline = time.monotonic() + 60
    while True:
        status, _, body = post(url, "/v1/metrale/usage?tenant=anonymous", b"", method="GET")
        assert status == 200, body
        got = body["data"][0]["completion_tokens"]
        if got >= expected or time.monotonic() > deadline:
            return got
        time.sleep(0.05)  # polling the route for a record the server writes


def _logged_tokens(usage_log: Path) -> int:
    """The generated tokens the usage log holds."""
    lines = usage_log.read_text().splitlines() if usage_log.exists() else []
    return sum(json.loads(line)["completion_tokens"] for line in lines)


def _answered(entries: list[dict]) -> list[dict]:
    return [e for e in entries if e["route"] == "/v1/completions" and e["status"] == 200]


def _dumped(dumps: Path, completions: int) -> list[dict]:
    """The dump entries (read as `metrale replay` reads them) once the lines of `completions`
    answered completions are written (the writer thread writes each just after its answer)."""
    deadline = time.monotonic() + 60
    while True:
        try:
            entries, unreadable = load_entries(dumps)
        except Exception:  # no file yet
            entries, unreadable = [], 0
        if len(_answered(entries)) >= completions:
            assert unreadable == 0
            return entries
        assert time.monotonic() < deadline, entries
        time.sleep(0.05)  # polling the folder for a line the server writes


def _stream_in_flight(url: str) -> http.client.HTTPConnection:
    """A streamed completion that has sent its first chunk and goes on (64 tokens)."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    conn.request("POST", "/v1/completions", json.dumps({**BODY, "max_tokens": 64,
                                                        "stream": True}),
                 {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    while not resp.readline().startswith(b"data:"):
        pass
    return conn


def test_killed_during_the_background_compile_restarts_from_the_cache(tiny_model, tmp_path,
                                                                      monkeypatch):
    monkeypatch.setenv("METRALE_JAX_CACHE", str(tmp_path / "jax"))  # empty: a cold start
    monkeypatch.setenv("METRALE_EXECUTABLE_CACHE", "1")  # programs stored, loaded untraced
    dumps = tmp_path / "dumps"
    proc, url = _serve(tiny_model, dumps)
    try:
        compiling = _stats(url)["background_compile"]
        assert not compiling["complete"] and compiling["total"] > compiling["done"]
        status, _, first = post(url, "/v1/completions", BODY)
        assert status == 200, first
        before = _dumped(dumps, 1)
        assert _completion_tokens(url, 8) == first["usage"]["completion_tokens"] == 8
        assert _logged_tokens(tmp_path / "usage.jsonl") == 8  # written as it was counted
        stream = _stream_in_flight(url)
        proc.send_signal(signal.SIGKILL)  # mid-stream
        assert proc.wait(60) == -signal.SIGKILL
        stream.close()
    finally:
        stop_cli_server(proc)

    proc, url = _serve(tiny_model, dumps)  # the same flags and caches, none torn
    try:
        status, _, again = post(url, "/v1/completions", BODY)
        assert status == 200, again
        assert again["choices"][0]["text"] == first["choices"][0]["text"]
        # the answer before the kill is still counted (the stream cut by the kill is not)
        assert _completion_tokens(url, 16) == 8 + again["usage"]["completion_tokens"] == 16
        after = _dumped(dumps, 2)  # every line before the kill, whole
        assert [e["seq"] for e in after[:len(before)]] == [e["seq"] for e in before]
        assert after[:len(before)] == before
        (mine,) = _answered(before)
        assert mine["outcome"]["texts"] == [first["choices"][0]["text"]]
        deadline = time.monotonic() + 600
        while not (stats := _stats(url))["background_compile"]["complete"]:
            assert time.monotonic() < deadline, stats["background_compile"]
            time.sleep(0.2)  # polling the stats route for an event the server reports
        compiling = stats["background_compile"]
        assert compiling["done"] == compiling["total"] > 0
        compiles = stats["compiles"]
        status, _, _ = post(url, "/v1/completions", {**BODY, "prompt": "fox " * 30})
        assert status == 200
        assert _stats(url)["compiles"] == compiles  # the grid is complete: flat
    finally:
        stop_cli_server(proc)
