"""The watchdog and failed steps over HTTP, on the shared tiny-model server: /health 503 with
the reason and back to 200, the waiting and new requests' 503s (OpenAI and Anthropic
shapes), a failed step's 500 (whole and streamed), the counters in the stats and /metrics.

The loop is held in its step (tests/step_gate.py) and the stall timeout made short only
while it is held; waits are on the watchdog's checks, never on time.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from metrale_jax.scheduler.step_failures import UNHEALTHY_AFTER
from tests.serving.conftest import MODEL, OpenStream, get_json, post, sse_events
from tests.step_gate import gated

BODY = {"model": MODEL, "prompt": "the quick brown fox", "max_tokens": 4, "temperature": 0,
        "ignore_eos": True}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
        "temperature": 0}
MESSAGES = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def _until(scheduler, cond: Callable[[], bool], ticks: int = 600) -> bool:
    for _ in range(ticks):
        if cond():
            return True
        assert scheduler.health.watchdog.wait_ticks(1)
    return cond()


def _health(url: str) -> tuple[int, dict]:
    status, _, body = post(url, "/health", b"", method="GET")
    return status, body


def _metric(url: str, name: str) -> float:
    import urllib.request
    with urllib.request.urlopen(url + "/metrics", timeout=60) as r:
        text = r.read().decode()
    line = next(ln for ln in text.splitlines() if ln.startswith(name + " "))
    return float(line.split()[1])


def test_a_stalled_loop_answers_503_until_it_goes_on(server, base_url):
    scheduler = server.state.runtime.scheduler
    watchdog = scheduler.health.watchdog
    before, stalls = watchdog.timeout, _metric(base_url, "metrale:stalls_total")
    with gated(scheduler.engine) as gate, ThreadPoolExecutor(1) as pool:
        running = OpenStream(base_url, "/v1/completions", BODY)
        assert gate.entered.wait(60)
        waiting = pool.submit(post, base_url, "/v1/chat/completions", CHAT)
        assert _until(scheduler, lambda: scheduler.snapshot()["waiting"] == 1)
        watchdog.set_timeout(0.3)
        try:
            assert _until(scheduler, lambda: watchdog.stalled is not None)
        finally:
            watchdog.set_timeout(before)
        status, headers, body = waiting.result(60)
        assert status == 503 and headers["Retry-After"]
        assert body["error"]["type"] == "server_error" and body["error"]["code"] == "stalled"
        status, body = _health(base_url)
        assert status == 503 and body["status"] == "stalled"
        assert "made no progress" in body["reason"] and body["error"]["code"] == "stalled"
        status, _, body = post(base_url, "/v1/chat/completions", CHAT)  # new: refused
        assert status == 503 and body["error"]["code"] == "stalled"
        status, _, body = post(base_url, "/v1/messages", MESSAGES)  # Anthropic's shape
        assert status == 503 and body["type"] == "error" and "stalled" in str(body["error"])
        stats = get_json(base_url, "/v1/metrale/stats")
        assert "made no progress" in stats["health"]
        assert _metric(base_url, "metrale:stalls_total") == stalls + 1
        assert _metric(base_url, "metrale:unhealthy") == 1.0
    assert running.finish()[-1] == "[DONE]"
    assert _until(scheduler, lambda: _health(base_url)[0] == 200)
    assert _health(base_url)[1] == {"status": "ready"}
    assert post(base_url, "/v1/chat/completions", CHAT)[0] == 200


def test_a_failing_step_answers_500_and_repeats_turn_health_503(server, base_url):
    scheduler = server.state.runtime.scheduler
    engine = scheduler.engine
    failures = _metric(base_url, "metrale:step_failures_total")
    raising = [0]
    real = type(engine).step

    def step(*args, **kwargs):
        if raising[0]:
            raising[0] -= 1
            raise RuntimeError("injected step fault")
        return real(engine, *args, **kwargs)

    engine.step = step
    try:
        raising[0] = UNHEALTHY_AFTER
        status, _, body = post(base_url, "/v1/chat/completions", CHAT)
        assert status == 500
        assert body["error"]["type"] == "server_error"
        assert body["error"]["code"] == "step_failed"
        events = sse_events(base_url, "/v1/completions", {**BODY, "stream": True})
        assert events[-1] == "[DONE]" and "error" in events[-2]
        assert events[-2]["error"]["code"] == "step_failed"
        assert _health(base_url)[0] == 200  # two failures in a row: still healthy
        status, _, body = post(base_url, "/v1/messages", MESSAGES)
        assert status == 500 and body["type"] == "error"
        status, body = _health(base_url)
        assert status == 503 and body["status"] == "failing"
        assert f"{UNHEALTHY_AFTER} steps in a row failed" in body["reason"]
        assert _metric(base_url, "metrale:step_failures_total") == failures + UNHEALTHY_AFTER
    finally:
        raising[0] = 0
        del engine.step
    assert post(base_url, "/v1/chat/completions", CHAT)[0] == 200
    assert _health(base_url) == (200, {"status": "ready"})
    snap = scheduler.snapshot()
    assert not any(snap["slots"]) and snap["waiting"] == 0
    assert engine.pages.free_pages == engine.pages.usable_pages
