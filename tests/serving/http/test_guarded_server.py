"""`metrale serve` as a subprocess with an API key, one slot and a one-request queue.

Over real HTTP: the key is enforced (health stays open), a really full queue answers 503 with
Retry-After, and after SIGTERM `/health` answers 503 while the in-flight stream finishes.
"""

from __future__ import annotations

import http.client
import json
import re
import signal
import threading
import time
from urllib.parse import urlparse

import pytest

from tests.serving.conftest import post, start_cli_server, stop_cli_server

KEY = {"Authorization": "Bearer sekrit"}
LONG = {"model": "tiny", "prompt": "fox", "max_tokens": 4000, "temperature": 0,
        "ignore_eos": True, "stream": True}


@pytest.fixture(scope="module")
def guarded(tiny_model):
    proc, url = start_cli_server(
        "--model", str(tiny_model), "--served-model-name", "tiny", "--max-slots", "1",
        "--max-len", "4096", "--max-prefill-len", "64", "--max-waiting", "1",
        "--api-key", "sekrit", "--grace-period", "60")
    yield proc, url
    stop_cli_server(proc)


class Stream:
    """A streaming request in a thread; `first` is set once its first chunk arrived."""

    def __init__(self, url: str, body: dict):
        self.first = threading.Event()
        self.status: int | None = None
        self.events: list = []
        u = urlparse(url)
        self.conn = http.client.HTTPConnection(u.hostname, u.port, timeout=120)
        self.thread = threading.Thread(target=self._run, args=(body,), daemon=True)
        self.thread.start()

    def _run(self, body: dict) -> None:
        self.conn.request("POST", "/v1/completions", json.dumps(body),
                          {"Content-Type": "application/json", **KEY})
        resp = self.conn.getresponse()
        self.status = resp.status
        try:
            for raw in resp:
                line = raw.decode().strip()
                if line.startswith("data: "):
                    payload = line[6:]
                    self.events.append(payload if payload == "[DONE]" else json.loads(payload))
                    self.first.set()
        except (OSError, AttributeError):  # the test closed this client mid-stream
            pass
        finally:
            self.first.set()


def _waiting(url: str) -> float:
    import urllib.request
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    return float(re.search(r"^metrale:num_requests_waiting (\S+)$", text, re.M).group(1))


def test_api_key_over_http(guarded, schemas):
    _, url = guarded
    assert post(url, "/v1/models", b"", method="GET")[0] == 401
    status, _, body = post(url, "/v1/models", b"", {"Authorization": "Bearer nope"}, "GET")
    assert status == 401
    schemas.error(body)
    assert post(url, "/v1/models", b"", KEY, "GET")[0] == 200
    assert post(url, "/health", b"", method="GET")[0] == 200


def test_full_queue_is_503_with_retry_after(guarded, schemas):
    _, url = guarded
    running = Stream(url, LONG)
    assert running.first.wait(60) and running.status == 200  # holds the only slot
    waiting = Stream(url, {**LONG, "max_tokens": 4})  # fills the one-place queue
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and _waiting(url) < 1:  # until it is really queued
        pass
    status, headers, body = post(url, "/v1/completions",
                                 {"model": "tiny", "prompt": "x", "max_tokens": 2}, KEY)
    assert status == 503, (status, body)
    assert float(headers["Retry-After"]) > 0
    schemas.error(body)
    running.conn.close()  # the client goes: its request is cancelled, the queue drains
    waiting.thread.join(60)
    assert waiting.events[-1] == "[DONE]"


def test_health_is_503_while_draining(guarded):
    proc, url = guarded
    stream = Stream(url, {**LONG, "max_tokens": 600})
    assert stream.first.wait(60)
    proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 30
    seen = None
    while time.monotonic() < deadline and seen != 503:
        seen = post(url, "/health", b"", method="GET")[0]
    assert seen == 503
    stream.thread.join(90)
    assert stream.events[-1] == "[DONE]"
    finish = [e for e in stream.events[:-1] if e.get("choices")][-1]["choices"][0]
    assert finish["finish_reason"] == "length"  # finished within the grace period
    assert proc.wait(90) == 0
