"""`metrale bench` against the shared tiny-model server, its length distributions and its
summaries, and `bench/serve.py`, the wrapper that keeps the old command working."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import pytest

from metrale_jax.errors import InvalidParameterError
from serving.cli.bench_load import (
    BenchConfig,
    Dist,
    LevelResult,
    RequestResult,
    parse_dist,
    plan,
    run_level,
    summarize,
)
from serving.cli.http_client import Client
from tests.serving.conftest import MODEL, ROOT, run_main


def bench(*args: str, script: str | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, script] if script else [sys.executable, "-m", "serving.cli", "bench"]
    return subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=300,
                          cwd=ROOT, env={**os.environ, "JAX_PLATFORMS": "cpu",
                                         "MPLBACKEND": "Agg"})


@pytest.mark.parametrize("text, dist", [
    ("128", Dist("fixed", 128)), ("64:256", Dist("uniform", 64, 256)),
    ("normal:100:20", Dist("normal", 100, 20)), (" 8 ", Dist("fixed", 8)),
])
def test_parse_dist(text, dist):
    assert parse_dist(text) == dist
    assert parse_dist(str(dist)) == dist  # printed as it is read


@pytest.mark.parametrize("text", ["0", "-3", "9:2", "x", "1:2:3", "normal:5", "normal:5:-1",
                                  "normal:nan:1", ""])
def test_parse_dist_rejects(text):
    with pytest.raises(InvalidParameterError, match="--prompt-len"):
        parse_dist(text, "--prompt-len")


def test_draws_are_seeded_and_in_range():
    cfg = BenchConfig(model="m", prompt_len=Dist("uniform", 4, 9),
                      output_len=Dist("normal", 3, 10))
    a, b = plan(cfg, 200, level=4), plan(cfg, 200, level=4)
    assert [(r.prompt_words, r.max_tokens) for r in a] == [(r.prompt_words, r.max_tokens)
                                                           for r in b]
    assert {r.prompt_words for r in a} == set(range(4, 10))
    assert min(r.max_tokens for r in a) == 1  # a normal draw is clipped at 1
    assert Dist("normal", 50, 0).sample(random.Random(0)) == 50


def test_summary_percentiles_and_rates():
    results = [RequestResult(i, 4, 10, ok=True, ttft=0.1 * (i + 1), tpot=0.01, e2e=1.0,
                             output_tokens=10) for i in range(10)]
    results.append(RequestResult(10, 4, 10, error="boom"))
    row = summarize(LevelResult(4, 2.0, results))
    assert (row["requests"], row["failed"], row["output_tokens"]) == (11, 1, 100)
    assert row["ttft_p50"] == pytest.approx(0.55) and row["ttft_p90"] == pytest.approx(0.91)
    assert row["tok_s_p99"] == pytest.approx(10.0)
    assert row["output_tok_s"] == pytest.approx(50.0) and row["req_s"] == pytest.approx(5.0)


def test_bench_against_the_server(base_url, tmp_path):
    out, png = tmp_path / "raw.json", tmp_path / "plot.png"
    r = bench("--url", base_url, "--concurrency", "1", "3", "--requests", "3",
              "--prompt-len", "4:8", "--output-len", "6", "--out", str(out), "--plot", str(png))
    assert r.returncode == 0, r.stderr
    title, head, rule, one, three = r.stdout.splitlines()
    assert title.startswith(f"{MODEL} at {base_url}: completions, streaming")
    assert "TTFT ms p50/p90/p99" in head and set(rule) == {"-"}
    assert one.split()[:3] == ["1", "3", "0"] and three.split()[:3] == ["3", "3", "0"]
    data = json.loads(out.read_text())
    assert data["config"]["prompt_len"] == "4:8" and data["config"]["model"] == MODEL
    for level in data["levels"]:
        assert len(level["requests"]) == 3
        for q in level["requests"]:
            assert q["ok"] and q["output_tokens"] == 6 and 4 <= q["prompt_words"] <= 8
            assert 0 < q["ttft"] <= q["e2e"] and q["prompt_tokens"] > 0
            assert q["tpot"] is None or q["tpot"] > 0  # None: a request with no text chunks
        assert level["summary"]["output_tok_s"] > 0
        assert level["summary"]["tpot_p50"] > 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_chat_endpoint_without_streaming(base_url):
    cfg = BenchConfig(model=MODEL, endpoint="chat", stream=False, prompt_len=Dist("fixed", 3),
                      output_len=Dist("fixed", 5))
    level = run_level(Client(base_url), cfg, concurrency=2, requests=2)
    for r in level.results:
        assert r.ok and r.output_tokens == 5 and r.ttft is None and r.e2e > 0
    assert summarize(level)["ttft_p50"] is None


def test_every_request_failing_is_a_runtime_failure(base_url):
    r = bench("--url", base_url, "--concurrency", "2", "--requests", "2",
              "--prompt-len", "400", "--output-len", "4")  # longer than the context
    assert r.returncode == 1
    assert "every request failed" in r.stderr and "maximum context length" in r.stderr


@pytest.mark.parametrize("args, needle", [
    (["--concurrency", "0"], "--concurrency 0"),
    (["--concurrency", "two"], "not an integer"),
    (["--output-len", "5:1"], "--output-len"),
    (["--requests", "0"], "--requests"),
    (["--url", "http://[::1"], "--url"),
])
def test_bad_usage(args, needle, capsys):
    code, _, err = run_main(capsys, "bench", *args)
    assert code == 2 and needle in err and "Traceback" not in err


def test_unreachable_server(capsys):
    code, _, err = run_main(capsys, "bench", "--url", "http://127.0.0.1:9", "--requests", "1")
    assert code == 1 and "cannot reach http://127.0.0.1:9" in err


def test_bench_serve_py_is_the_same_command(base_url):
    r = bench("--url", base_url, "--concurrency", "2", "--requests", "2", "--prompt-len", "4",
              "--output-len", "3", script=str(ROOT / "bench" / "serve.py"))
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[-1].split()[:3] == ["2", "2", "0"]
