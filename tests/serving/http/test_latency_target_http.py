"""The request field `max_itl_ms` (the latency target, scheduler/step_time.py) on the shared
tiny-model server: validated (400 naming it), carried to the engine request, clamped by the
scheduler; and the target and step times in /v1/metrale/stats."""

from __future__ import annotations

import contextlib
import urllib.request

import pytest

from metrale_jax.scheduler.step_time import DEFAULT_MAX_ITL_MS
from tests.serving.conftest import MODEL, get_json, post

COMPLETION = {"model": MODEL, "prompt": "the quick brown fox", "max_tokens": 2,
              "temperature": 0}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
        "temperature": 0}
ANTHROPIC = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
             "max_tokens": 2}
RESPONSES = {"model": MODEL, "input": "hi", "max_output_tokens": 2}
ROUTES = [("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT),
          ("/v1/messages", ANTHROPIC), ("/v1/responses", RESPONSES)]


@contextlib.contextmanager
def submitted(server):
    """The `GenerationRequest`s the scheduler is given while the block runs."""
    scheduler = server.state.runtime.scheduler
    seen, real = [], scheduler.submit

    def submit(request, *args, **kwargs):
        seen.append(request)
        return real(request, *args, **kwargs)
    scheduler.submit = submit
    try:
        yield seen
    finally:
        del scheduler.submit


@pytest.mark.parametrize("path,body", ROUTES)
@pytest.mark.parametrize("bad", [0, -5, "fast", [1]])
def test_a_bad_max_itl_ms_is_a_400_naming_it(base_url, path, body, bad):
    status, _, answer = post(base_url, path, {**body, "max_itl_ms": bad})
    assert status == 400
    assert "max_itl_ms" in str(answer)


@pytest.mark.parametrize("path,body", ROUTES)
def test_the_request_target_reaches_the_scheduler(server, base_url, path, body):
    with submitted(server) as seen:
        status, _, _ = post(base_url, path, {**body, "max_itl_ms": 5})
        assert status == 200
        status, _, _ = post(base_url, path, body)
        assert status == 200
    assert [r.max_itl_ms for r in seen] == [5, None]


def test_stats_report_the_target_and_the_step_times(server, base_url):
    post(base_url, "/v1/completions", {**COMPLETION, "max_tokens": 8})
    latency = get_json(base_url, "/v1/metrale/stats")["latency"]
    model = server.state.runtime.scheduler.step_times
    assert latency["max_itl_ms"] == DEFAULT_MAX_ITL_MS and latency["floor_ms"] == 20.0
    # a request asking for less than the floor gets the floor; more than the server's: its
    assert model.target_s([5]) == pytest.approx(0.02)
    assert model.target_s([10_000]) == pytest.approx(DEFAULT_MAX_ITL_MS / 1000)
    shapes = {(s["rows"], s["chunk"], s["late"]): s for s in latency["shapes"]}
    # warmup "full": every mixed shape was timed; decode steps were observed since
    assert all(shapes[(n, c, False)]["measured_at_warmup_ms"] > 0
               for n in model.rows for c in model.buckets)
    observed = [s for s in latency["shapes"] if s["steps"]]
    assert observed and all(s["actual_ms"] > 0 and s["predicted_ms"] > 0 for s in observed)
    with urllib.request.urlopen(base_url + "/metrics", timeout=30) as r:
        assert f"metrale:max_itl_ms {DEFAULT_MAX_ITL_MS}" in r.read().decode()
