"""One real server (Hypercorn on a loopback port, a tiny random Llama) shared by the session."""

from __future__ import annotations

import contextlib
import json
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from devtools.hf_models import build_tiny_checkpoint

ROOT = Path(__file__).resolve().parents[2]
SPEC = ROOT.parent / "shared" / "openai-openapi.yaml"
DEFAULT_GGUF = ROOT / "checkpoints" / "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL = "tiny"
MAX_LEN = 256


def wait_healthy(url: str, timeout: float = 300.0) -> None:
    """Polls /health until 200, with a deadline."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{url} not healthy after {timeout} s")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny-llama-serving"))


@pytest.fixture(scope="session")
def server(tiny_model):
    from serving.http.server import ServerThread
    from serving.http.settings import ServerSettings
    settings = ServerSettings(
        model=str(tiny_model), served_model_name=MODEL, port=0, max_slots=8, max_len=MAX_LEN,
        engine_options={"max_prefill_len": 64}, max_body_bytes=256 * 1024,
        request_timeout=120.0, grace_period=5.0, warmup="full")
    srv = ServerThread(settings).start()
    assert srv.wait_ready(timeout=600), "the server did not become ready"
    wait_healthy(srv.url)
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def base_url(server) -> str:
    return server.url


@pytest.fixture(scope="session")
def client(base_url):
    import openai
    return openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0,
                         timeout=120)


@pytest.fixture(scope="session")
def async_client_factory(base_url):
    import openai

    def make():
        return openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0,
                                  timeout=120)
    return make


@pytest.fixture(scope="session")
def tokenizer(server):
    return server.state.runtime.tokenizer


def post(url: str, path: str, body: bytes | dict | str, headers: dict | None = None,
         method: str = "POST") -> tuple[int, Any, Any]:
    """A raw HTTP request: (status, headers (case-insensitive), decoded JSON body)."""
    data = body if isinstance(body, bytes) else (
        body.encode() if isinstance(body, str) else json.dumps(body).encode())
    req = urllib.request.Request(url + path, data=data if method != "GET" else None,
                                 method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, r.headers, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        raw = e.read()
        return e.code, e.headers, json.loads(raw) if raw else None


def sse_events(url: str, path: str, body: dict, headers: dict | None = None) -> list:
    """POSTs a streaming request; returns every `data:` payload (dicts, and "[DONE]")."""
    import http.client
    from urllib.parse import urlparse
    u = urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=120)
    try:
        conn.request("POST", path, json.dumps(body),
                     {"Content-Type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        assert resp.status == 200, (resp.status, resp.read())
        assert resp.getheader("content-type", "").startswith("text/event-stream")
        out = []
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            payload = line[len("data: "):]
            out.append(payload if payload == "[DONE]" else json.loads(payload))
        return out
    finally:
        conn.close()


@pytest.fixture(scope="session")
def schemas():
    from tests.serving.openai_schema import Validators
    if not SPEC.exists():  # CI lays shared/ beside the clone; its absence is a setup error
        pytest.fail(f"{SPEC} is missing: the OpenAI spec must lie in ../shared/")
    return Validators(SPEC)


def start_cli_server(*args: str):
    """Starts `metrale serve --port 0 ARGS` as a subprocess; returns (process, base URL) once
    it printed its URL (fails the test with its stderr if it never does)."""
    import os
    import re
    import subprocess
    import sys
    cmd = [sys.executable, "-m", "serving.cli", "serve", "--port", "0", *args]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    line = proc.stdout.readline()  # blocks until ready (or the process ends)
    match = re.search(r"at (http://\S+)/v1", line)
    if match is None:
        proc.kill()
        pytest.fail(f"no URL printed: {line!r} {proc.stderr.read()[-2000:]}")
    return proc, match.group(1)


def stop_cli_server(proc) -> None:
    """Kills a `start_cli_server` process if it still runs."""
    if proc.poll() is None:
        proc.kill()
        proc.wait()


@contextlib.contextmanager
def paused_decode(server):
    """Holds the server's batching loop inside its next decode step until the block ends.

    Yields a `threading.Event` set once the loop is held: from then on the requests in the
    slots stay there and new ones wait in the queue, so a test can look at a moment of the
    server that would otherwise pass in milliseconds. The engine's own `step` runs on release.
    """
    engine = server.state.runtime.scheduler.engine
    entered, release = threading.Event(), threading.Event()
    real = engine.step

    def step(*args, **kwargs):
        entered.set()
        release.wait(120)
        return real(*args, **kwargs)

    engine.step = step
    try:
        yield entered
    finally:
        release.set()
        del engine.step  # the class's method again


class OpenStream:
    """A streaming POST whose answer has started (its request is queued in the scheduler).

    request_id: the server's `x-request-id`; the engine request of choice 0 is
    `f"{request_id}-0"`. `finish()` reads the rest and returns the `data:` payloads.
    """

    def __init__(self, url: str, path: str, body: dict):
        import http.client
        from urllib.parse import urlparse
        u = urlparse(url)
        self.conn = http.client.HTTPConnection(u.hostname, u.port, timeout=120)
        self.conn.request("POST", path, json.dumps({**body, "stream": True}),
                          {"Content-Type": "application/json"})
        self.resp = self.conn.getresponse()  # the headers come once the request is queued
        assert self.resp.status == 200, self.resp.read()
        self.request_id = self.resp.getheader("x-request-id")

    def finish(self) -> list:
        out = []
        try:
            for raw in self.resp:
                line = raw.decode().strip()
                if line.startswith("data: "):
                    payload = line[len("data: "):]
                    out.append(payload if payload == "[DONE]" else json.loads(payload))
        finally:
            self.conn.close()
        return out


def get_json(url: str, path: str) -> Any:
    """GET `path` as JSON (fails the test on an error status)."""
    with urllib.request.urlopen(url + path, timeout=60) as r:
        return json.loads(r.read())


def run_main(capsys, *args: str) -> tuple[int, str, str]:
    """`metrale ARGS` in this process (fast, for exit codes): (code, stdout, stderr)."""
    from serving.cli import main
    try:
        code = main(list(args))
    except SystemExit as e:  # argparse's usage errors and --help
        code = int(e.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="session")
def tool_model(tmp_path_factory) -> Path:
    """A tiny random Qwen2 whose vocabulary has `<think>`, `</think>`, `<tool_call>` and
    `</tool_call>` and whose template is Hermes-style (devtools/hf_models.py)."""
    from devtools.hf_models import build_tool_checkpoint
    return build_tool_checkpoint(tmp_path_factory.mktemp("tiny-tools"))


TOOL_MODEL = "tiny-tools"


@pytest.fixture(scope="session")
def tool_server(tool_model):
    """A server of the tool model (tool-call and think tags in its vocabulary and template),
    shared by the session; the shared server's shapes, so its programs come from the
    persistent compilation cache."""
    from serving.http.server import ServerThread
    from serving.http.settings import ServerSettings
    settings = ServerSettings(
        model=str(tool_model), served_model_name=TOOL_MODEL, port=0, max_slots=8,
        max_len=MAX_LEN, engine_options={"max_prefill_len": 64}, request_timeout=120.0,
        grace_period=5.0, warmup="full")
    srv = ServerThread(settings).start()
    assert srv.wait_ready(timeout=600), "the tool server did not become ready"
    wait_healthy(srv.url)
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def tool_tokenizer(tool_model):
    from metrale_jax.text import load_tokenizer
    return load_tokenizer(tool_model)
