"""`metrale serve` (default `--warmup serve`) answers while the rest of its grid compiles in the
background, shows the progress in `/v1/metrale/stats`, and a server killed (SIGKILL) during
that compile restarts cleanly from its persistent compilation cache and stored programs
(engine/executable_store.py), then completes the grid."""

from __future__ import annotations

import json
import signal
import time
import urllib.request

from tests.serving.conftest import post, start_cli_server, stop_cli_server

BODY = {"model": "tiny", "prompt": "the quick brown fox", "max_tokens": 8, "temperature": 0,
        "ignore_eos": True}


def _stats(url: str) -> dict:
    with urllib.request.urlopen(url + "/v1/metrale/stats", timeout=30) as resp:
        return json.loads(resp.read())


def _serve(tiny_model):
    return start_cli_server("--model", str(tiny_model), "--served-model-name", "tiny",
                            "--max-slots", "2", "--max-len", "128", "--max-prefill-len", "32")


def test_killed_during_the_background_compile_restarts_from_the_cache(tiny_model, tmp_path,
                                                                      monkeypatch):
    monkeypatch.setenv("METRALE_JAX_CACHE", str(tmp_path / "jax"))  # empty: a cold start
    monkeypatch.setenv("METRALE_EXECUTABLE_CACHE", "1")  # programs stored, loaded untraced
    proc, url = _serve(tiny_model)
    try:
        compiling = _stats(url)["background_compile"]
        assert not compiling["complete"] and compiling["total"] > compiling["done"]
        status, _, first = post(url, "/v1/completions", BODY)
        assert status == 200, first
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(60) == -signal.SIGKILL
    finally:
        stop_cli_server(proc)

    proc, url = _serve(tiny_model)  # the same cache, some entries written, none torn
    try:
        status, _, again = post(url, "/v1/completions", BODY)
        assert status == 200, again
        assert again["choices"][0]["text"] == first["choices"][0]["text"]
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
