"""Speculative decoding (prompt lookup) over HTTP: per-request `speculative`, the output equal to
decoding without it (greedy and seeded, alone and in a batch with requests that do not
speculate), streaming and stops, the acceptance counters in /metrics and /v1/metrale/stats,
and 400 for bad values.

One server of the shared server's shapes with `speculative_tokens=3`, without warmup: the
programs it runs are compiled when first used (its step programs come from the compilation
cache the shared server fills; the verify programs are new).
"""

from __future__ import annotations

import concurrent.futures
import re
import urllib.request

import pytest

from tests.serving.conftest import (
    MAX_LEN,
    MODEL,
    get_json,
    post,
    run_main,
    sse_events,
    wait_healthy,
)

pytestmark = pytest.mark.xdist_group("tiny-server")

# Repeated n-grams: prompt lookup drafts at once, and the random model often copies them.
PROMPT = [40, 41, 42, 43, 44, 45, 46, 47] * 6


@pytest.fixture(scope="module")
def spec_url(tiny_model):
    from serving.http.server import ServerThread
    from serving.http.settings import ServerSettings
    settings = ServerSettings(
        model=str(tiny_model), served_model_name=MODEL, port=0, max_slots=8, max_len=MAX_LEN,
        engine_options={"max_prefill_len": 64, "speculative_tokens": 3},
        request_timeout=120.0, grace_period=5.0, warmup=False)
    srv = ServerThread(settings).start()
    assert srv.wait_ready(timeout=600), "the server did not become ready"
    wait_healthy(srv.url)
    yield srv.url
    srv.stop()


def _metric(url: str, name: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    m = re.search(rf"^metrale:{name}(?:_total)? (\S+)$", text, re.M)
    assert m, f"{name} not in /metrics"
    return float(m.group(1))


def _complete(url: str, k: int | None, **body) -> dict:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 24, "temperature": 0,
            "logprobs": 2, **body}
    if k is not None:
        body["speculative"] = {"num_tokens": k}
    status, _, out = post(url, "/v1/completions", body)
    assert status == 200, out
    return out["choices"][0]


def test_greedy_equals_plain_decoding_and_counts_acceptance(spec_url):
    drafted = _metric(spec_url, "spec_decode_num_draft_tokens")
    accepted = _metric(spec_url, "spec_decode_num_accepted_tokens")
    plain = _complete(spec_url, 0)
    spec = _complete(spec_url, None)  # the server's default: 3
    assert spec["text"] == plain["text"] and spec["finish_reason"] == "length"
    assert spec["logprobs"]["tokens"] == plain["logprobs"]["tokens"]
    for a, b in zip(spec["logprobs"]["token_logprobs"], plain["logprobs"]["token_logprobs"],
                    strict=True):
        assert a == pytest.approx(b, abs=1e-4)
    assert len(spec["logprobs"]["tokens"]) == 24  # max_tokens holds with several per step
    new_drafted = _metric(spec_url, "spec_decode_num_draft_tokens") - drafted
    new_accepted = _metric(spec_url, "spec_decode_num_accepted_tokens") - accepted
    assert new_drafted > 0 and 0 < new_accepted <= new_drafted
    counters = get_json(spec_url, "/v1/metrale/stats")["counters"]
    assert counters["spec_accepted"] >= new_accepted


def test_seeded_batch_with_and_without_speculation(spec_url):
    """Seeded sampled requests, half speculating, sent together: each one's text is its text
    alone without speculation."""
    alone = [_complete(spec_url, 0, temperature=1.0, seed=s, top_k=8)["text"]
             for s in range(4)]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(_complete, spec_url, (3 if i % 2 else 0), temperature=1.0,
                               seed=i % 4, top_k=8) for i in range(8)]
        together = [f.result()["text"] for f in futures]
    assert together == alone + alone


def test_streaming_and_stop_strings(spec_url):
    plain = _complete(spec_url, 0, max_tokens=30)["text"]
    events = sse_events(spec_url, "/v1/completions", {
        "model": MODEL, "prompt": PROMPT, "max_tokens": 30, "temperature": 0, "stream": True,
        "speculative": {"num_tokens": 3}})
    streamed = "".join(e["choices"][0]["text"] for e in events if e != "[DONE]" and e["choices"])
    assert streamed == plain
    stop = plain[len(plain) // 2:len(plain) // 2 + 3]
    cut = _complete(spec_url, 3, max_tokens=30, stop=[stop])
    plain_cut = _complete(spec_url, 0, max_tokens=30, stop=[stop])
    assert cut["text"] == plain_cut["text"] and cut["finish_reason"] == "stop"


@pytest.mark.parametrize("value", [{"num_tokens": 4}, {"num_tokens": -1}, {"num_tokens": "x"},
                                   {"tokens": 2}, 3])
def test_bad_speculative_values_are_400(spec_url, value):
    for path, body in (("/v1/completions", {"prompt": "hi"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user",
                                                               "content": "hi"}]})):
        status, _, out = post(spec_url, path, {"model": MODEL, "max_tokens": 2,
                                               "speculative": value, **body})
        assert status == 400, (value, out)
        assert out["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("value", ["33", "-1"])
def test_serve_refuses_a_bad_speculative_tokens_flag(capsys, value):
    code, _, err = run_main(capsys, "serve", "--model", "unused", "--speculative-tokens", value)
    assert code == 2 and "--speculative-tokens must be from 0 (off) to 32" in err
