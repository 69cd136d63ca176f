"""`metrale serve` as a subprocess on the default model: URL printed, SIGTERM drains."""

from __future__ import annotations

import json
import signal
import threading

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

pytestmark = pytest.mark.default_model


@pytest.fixture(scope="module")
def cli_server():
    if not DEFAULT_GGUF.exists():
        pytest.skip(f"{DEFAULT_GGUF} is absent (run `metrale pull`)")
    shapes = DEFAULT_MODEL_SHAPES  # the default_llm fixture's: their programs are shared
    proc, url = start_cli_server("--max-slots", str(shapes["max_slots"]),
                                 "--max-len", str(shapes["max_len"]),
                                 "--max-prefill-len", str(shapes["max_prefill_len"]),
                                 "--grace-period", "30")
    yield proc, url
    stop_cli_server(proc)


def test_default_model_answers(cli_server, schemas):
    _, url = cli_server
    wait_healthy(url, timeout=30)
    status, _, models = post(url, "/v1/models", b"", method="GET")
    assert status == 200 and [m["id"] for m in models["data"]] == ["default"]
    status, _, body = post(url, "/v1/chat/completions", {
        "model": "default", "max_tokens": 8, "temperature": 0,
        "messages": [{"role": "user", "content": "What is the capital of France?"}]})
    assert status == 200, body
    schemas.chat(body)
    assert body["choices"][0]["message"]["content"].strip()


def test_sigterm_drains(cli_server):
    proc, url = cli_server
    result: dict = {}
    body = {"model": "default", "prompt": "Once upon a time", "max_tokens": 24,
            "temperature": 0, "ignore_eos": True, "stream": True}
    started = threading.Event()

    def stream():
        import http.client
        from urllib.parse import urlparse
        u = urlparse(url)
        conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
        conn.request("POST", "/v1/completions", json.dumps(body),
                     {"Content-Type": "application/json"})
        resp = conn.getresponse()
        events = []
        for raw in resp:
            if raw.startswith(b"data: "):
                events.append(raw[6:].strip().decode())
                started.set()
        result["events"] = events

    t = threading.Thread(target=stream)
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
        sse_events(url, "/v1/completions", body)
