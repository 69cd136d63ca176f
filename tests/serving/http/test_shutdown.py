"""Back-pressure and shutdown: 503 + Retry-After, and no accepted request left unanswered."""

from __future__ import annotations

import threading

from metrale_jax.errors import BusyError
from tests.serving.conftest import MAX_LEN, MODEL, post, sse_events


def test_queue_full_is_503_with_retry_after(server, base_url, schemas, monkeypatch):
    scheduler = server.state.runtime.scheduler

    def busy(*args, **kwargs):
        raise BusyError("the waiting queue is full", retry_after=2.5)

    monkeypatch.setattr(scheduler, "submit", busy)
    status, headers, out = post(base_url, "/v1/completions",
                                {"model": MODEL, "prompt": "x", "max_tokens": 2})
    assert status == 503 and headers["Retry-After"] == "3"
    schemas.error(out)
    monkeypatch.undo()
    assert post(base_url, "/health", b"", method="GET")[0] == 200


def test_stop_cancels_after_grace_and_answers(tiny_model, schemas):
    from serving.http.server import ServerThread
    from serving.http.settings import ServerSettings
    settings = ServerSettings(model=str(tiny_model), served_model_name=MODEL, port=0,
                              max_slots=8, max_len=MAX_LEN,
                              engine_options={"max_prefill_len": 64}, grace_period=0.01,
                              warmup="full")
    srv = ServerThread(settings).start()
    assert srv.wait_ready(timeout=600)
    body = {"model": MODEL, "prompt": "go", "max_tokens": MAX_LEN - 8, "ignore_eos": True}
    results: dict = {}
    started = threading.Barrier(3)

    def stream():
        started.wait()
        results["stream"] = sse_events(srv.url, "/v1/completions", {**body, "stream": True})

    def plain():
        started.wait()
        results["plain"] = post(srv.url, "/v1/completions", body)

    threads = [threading.Thread(target=stream), threading.Thread(target=plain)]
    for t in threads:
        t.start()
    started.wait()
    deadline_ok = _wait_running(srv, 2)
    assert deadline_ok
    srv.stop()
    for t in threads:
        t.join(30)
    events = results["stream"]
    assert events[-1] == "[DONE]"
    assert events[-2]["error"]["code"] == "shutting_down"
    schemas.error(events[-2])
    status, headers, out = results["plain"]
    assert status == 503 and "Retry-After" in headers
    schemas.error(out)


def _wait_running(srv, n: int, timeout: float = 30.0) -> bool:
    import time
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        snap = srv.state.runtime.scheduler.snapshot()
        if sum(s is not None for s in snap["slots"]) >= n:
            return True
        time.sleep(0.02)
    return False
