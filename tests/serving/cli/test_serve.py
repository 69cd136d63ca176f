"""`metrale serve` as a subprocess on the default model: URL printed, keys from an
--api-keys file re-read on SIGHUP while a stream is in flight (it completes), SIGTERM
drains."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest

from tests.conftest import DEFAULT_MODEL_SHAPES
from tests.serving.conftest import (
    DEFAULT_GGUF,
    post,
    sse_events,
    start_cli_server,
    stop_cli_server,
    wait_healthy,
)

# The "default-model" group (tests/conftest.py): this server compiles the default model on the
# default_llm fixture's shapes, so, on the same worker after those tests, most of its
# programs come from the persistent cache instead of being compiled twice at once.
pytestmark = [pytest.mark.default_model, pytest.mark.xdist_group("default-model")]


KEYS = '[[keys]]\nkey = "{key}"\ntenant = "t"\n'
ONE = {"Authorization": "Bearer sk-one"}
TWO = {"Authorization": "Bearer sk-two"}


@pytest.fixture(scope="module")
def keys_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("serve-keys") / "keys.toml"
    path.write_text(KEYS.format(key="sk-one"))
    return path


@pytest.fixture(scope="module")
def cli_server(keys_file):
    if not DEFAULT_GGUF.exists():
        pytest.skip(f"{DEFAULT_GGUF} is absent (run `metrale pull`)")
    shapes = DEFAULT_MODEL_SHAPES  # the default_llm fixture's: their programs are shared
    proc, url = start_cli_server("--max-slots", str(shapes["max_slots"]),
                                 "--max-len", str(shapes["max_len"]),
                                 "--max-prefill-len", str(shapes["max_prefill_len"]),
                                 "--grace-period", "30", "--api-keys", str(keys_file),
                                 "--tool-call-parser", "hermes")
    yield proc, url
    stop_cli_server(proc)


def _stream(url: str, body: dict, headers: dict, started: threading.Event,
            result: dict) -> None:
    """Streams `body`; `started` is set at the first event; `result["events"]` at the end."""
    import http.client
    from urllib.parse import urlparse
    u = urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    conn.request("POST", "/v1/completions", json.dumps(body),
                 {"Content-Type": "application/json", **headers})
    resp = conn.getresponse()
    events = []
    for raw in resp:
        if raw.startswith(b"data: "):
            events.append(raw[6:].strip().decode())
            started.set()
    result["events"] = events


def test_default_model_answers(cli_server, schemas):
    _, url = cli_server
    wait_healthy(url, timeout=30)
    assert post(url, "/v1/models", b"", method="GET")[0] == 401
    status, _, models = post(url, "/v1/models", b"", ONE, method="GET")
    assert status == 200 and [m["id"] for m in models["data"]] == ["default"]
    status, _, body = post(url, "/v1/chat/completions", {
        "model": "default", "max_tokens": 8, "temperature": 0,
        "messages": [{"role": "user", "content": "What is the capital of France?"}]}, ONE)
    assert status == 200, body
    schemas.chat(body)
    assert body["choices"][0]["message"]["content"].strip()


def test_a_required_tool_choice_ends_with_one_call(cli_server):
    """SmolLM2 under tool_choice "required" writes the same call three times over (greedy):
    the answer has it once, ends with "tool_calls", and has no content."""
    _, url = cli_server
    tools = [{"type": "function", "function": {
        "name": "get_tide", "description": "Tide times for a harbour",
        "parameters": {"type": "object", "properties": {"harbour": {"type": "string"}},
                       "required": ["harbour"]}}}]
    status, _, body = post(url, "/v1/chat/completions", {
        "model": "default", "max_tokens": 120, "temperature": 0, "tools": tools,
        "tool_choice": "required",
        "messages": [{"role": "user", "content": "When is high tide in Brest today?"}]}, ONE)
    assert status == 200, body
    choice = body["choices"][0]
    calls = choice["message"]["tool_calls"]
    assert [c["function"]["name"] for c in calls] == ["get_tide"], calls
    assert json.loads(calls[0]["function"]["arguments"])["harbour"]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None


def test_sighup_reloads_the_keys_while_a_stream_goes_on(cli_server, keys_file):
    """os.kill(SIGHUP) on the server process: the new file's key works and the old one is
    refused, while a stream started with the old key runs to its end."""
    proc, url = cli_server
    body = {"model": "default", "prompt": "Once upon a time", "max_tokens": 48,
            "temperature": 0, "ignore_eos": True, "stream": True}
    result: dict = {}
    started = threading.Event()
    t = threading.Thread(target=_stream, args=(url, body, ONE, started, result))
    t.start()
    assert started.wait(60)
    keys_file.write_text(KEYS.format(key="sk-two"))
    os.kill(proc.pid, signal.SIGHUP)
    deadline = time.monotonic() + 30
    while post(url, "/v1/models", b"", TWO, method="GET")[0] != 200:  # the reload's end
        assert time.monotonic() < deadline, "the keys were not reloaded"
        time.sleep(0.02)
    assert "events" not in result  # the stream was still in flight
    assert post(url, "/v1/models", b"", ONE, method="GET")[0] == 401
    t.join(60)
    events = result["events"]
    assert events[-1] == "[DONE]"
    finals = [json.loads(e) for e in events[:-1]]
    assert finals[-1]["choices"][0]["finish_reason"] == "length"
    assert sum(1 for f in finals if f["choices"][0]["text"]) >= 40  # the whole answer
    assert proc.poll() is None  # still serving
    keys_file.write_text(KEYS.format(key="sk-one"))  # back, for the next test
    os.kill(proc.pid, signal.SIGHUP)
    while post(url, "/v1/models", b"", ONE, method="GET")[0] != 200:
        assert time.monotonic() < deadline + 30, "the keys were not reloaded"
        time.sleep(0.02)


def test_sigterm_drains(cli_server):
    proc, url = cli_server
    result: dict = {}
    body = {"model": "default", "prompt": "Once upon a time", "max_tokens": 24,
            "temperature": 0, "ignore_eos": True, "stream": True}
    started = threading.Event()
    t = threading.Thread(target=_stream, args=(url, body, ONE, started, result))
    t.start()
    assert started.wait(60)
    proc.send_signal(signal.SIGTERM)
    t.join(60)
    events = result["events"]
    assert events[-1] == "[DONE]"
    finals = [json.loads(e) for e in events[:-1]]
    assert finals[-1]["choices"][0]["finish_reason"] == "length"  # finished within grace
    assert proc.wait(60) == 0
    with pytest.raises(OSError):
        sse_events(url, "/v1/completions", body, ONE)
