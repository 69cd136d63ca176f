"""GET /v1/metrale/stats on the shared tiny-model server: slots, queue, counters, errors."""

from __future__ import annotations

from tests.serving.conftest import MODEL, OpenStream, get_json, paused_decode, post

BODY = {"model": MODEL, "prompt": "the quick brown fox", "max_tokens": 8, "temperature": 0,
        "ignore_eos": True}


def test_stats_show_the_running_and_the_waiting_requests(server, base_url):
    before = get_json(base_url, "/v1/metrale/stats")
    with paused_decode(server) as held:
        first = OpenStream(base_url, "/v1/completions", BODY)
        assert held.wait(60), "the loop never reached a decode step"
        queued = [OpenStream(base_url, "/v1/completions", BODY) for _ in range(2)]
        stats = get_json(base_url, "/v1/metrale/stats")
    running = stats["slots"]["running"]
    assert [r["request_id"] for r in running] == [first.request_id + "-0"]
    assert running[0]["prompt_tokens"] > 0 and running[0]["running_s"] >= 0
    assert stats["slots"] == {**stats["slots"], "total": 8, "used": 1}
    assert stats["waiting"] == 2 and stats["requests_active"] == 3
    assert stats["state"] == "ready" and stats["model"] == MODEL
    assert stats["quantization"] is None  # float weights (int8: --quantization)
    assert stats["compiles"] == before["compiles"] > 0  # nothing compiles per request

    for s in [first, *queued]:
        assert s.finish()[-1] == "[DONE]"
    after = get_json(base_url, "/v1/metrale/stats")
    assert after["slots"]["used"] == 0 and after["waiting"] == 0
    assert after["counters"]["tokens"] - before["counters"]["tokens"] == 3 * 8
    assert after["counters"]["finished"] - before["counters"]["finished"] == 3
    assert after["counters"]["admitted"] - before["counters"]["admitted"] == 3


def test_stats_log_error_answers(base_url):
    before = get_json(base_url, "/v1/metrale/stats")["errors"]
    status, headers, _ = post(base_url, "/v1/completions", {**BODY, "temperature": -1})
    assert status == 400
    status_404, _, _ = post(base_url, "/v1/no-such-route", b"", method="GET")
    assert status_404 == 404
    errors = get_json(base_url, "/v1/metrale/stats")["errors"]
    assert errors["total"] - before["total"] == 2
    bad, missing = errors["recent"][-2:]
    assert bad["status"] == 400 and bad["request_id"] == headers["x-request-id"]
    assert "temperature" in bad["message"] and bad["type"] == "invalid_request_error"
    assert missing["status"] == 404
    assert errors["by_status"]["400"] >= 1 and errors["by_status"]["404"] >= 1
