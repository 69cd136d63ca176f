"""`metrale top` against the shared tiny-model server: the textual app driven headless by its
test pilot, the one-shot text mode, and the command's exit codes."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import pytest

from serving.cli.http_client import Client
from serving.cli.top_data import Sample, TopModel, parse_metrics, summary
from tests.serving.conftest import MODEL, ROOT, OpenStream, paused_decode, run_main

BODY = {"model": MODEL, "prompt": "jumps over the lazy dog", "max_tokens": 12,
        "temperature": 0, "ignore_eos": True}


def _rows(table) -> list[list[str]]:
    return [[str(c) for c in table.get_row_at(i)] for i in range(table.row_count)]


def test_dashboard_shows_slots_throughput_and_errors(server, base_url):
    from textual.widgets import DataTable, Sparkline, Static

    from serving.cli.top import build_app
    model = TopModel(Client(base_url))

    async def drive() -> None:
        app = build_app(model, interval=0)  # polls only when the test awaits app.poll()
        async with app.run_test(size=(150, 45)) as pilot:
            await app.poll()
            with paused_decode(server) as held:
                stream = await asyncio.to_thread(OpenStream, base_url, "/v1/completions",
                                                 BODY)
                assert await asyncio.to_thread(held.wait, 60)
                waiting = await asyncio.to_thread(OpenStream, base_url, "/v1/completions",
                                                  BODY)
                await app.poll()
                await pilot.pause()
                rows = _rows(app.query_one("#slots", DataTable))
                summary = str(app.query_one("#summary", Static).content)
            assert [r[1] for r in rows] == [stream.request_id + "-0"]
            assert "slots 1/8" in summary and "waiting 1" in summary
            assert "active requests 2" in summary
            for s in (stream, waiting):
                assert (await asyncio.to_thread(s.finish))[-1] == "[DONE]"
            bad = {**BODY, "max_tokens": 0}
            await asyncio.to_thread(_post_bad, base_url, bad)
            await app.poll()
            await pilot.pause()
            assert _rows(app.query_one("#slots", DataTable)) == []
            spark = app.query_one("#tput", Sparkline)
            assert len(spark.data) == 2 and spark.data[-1] > 0  # 24 tokens since the last poll
            assert max(model.ttft_ms) > 0
            errors = _rows(app.query_one("#errors", DataTable))
            assert errors and errors[0][1] == "400" and "max_tokens" in errors[0][3]
            await pilot.press("p")
            assert app.paused
            polls = app.polls
            await app.poll()  # paused: no new poll
            assert app.polls == polls
            await pilot.press("q")
        assert app.return_code == 0

    asyncio.run(drive())


def _post_bad(url: str, body: dict) -> None:
    from tests.serving.conftest import post
    status, _, _ = post(url, "/v1/completions", body)
    assert status == 400


def test_series_from_two_samples():
    model = TopModel(Client("http://127.0.0.1:9"))
    text0 = ("metrale:time_to_first_token_seconds_sum 1.0\n"
             "metrale:time_to_first_token_seconds_count 4.0\n")
    text1 = ("metrale:time_to_first_token_seconds_sum 1.5\n"
             "metrale:time_to_first_token_seconds_count 6.0\n"
             'metrale:request_success_total{finished_reason="length"} 3.0\n')
    model.add(Sample(10.0, {"counters": {"tokens": 100}}, parse_metrics(text0)))
    model.add(Sample(12.0, {"counters": {"tokens": 300}}, parse_metrics(text1)))
    assert list(model.throughput) == [100.0]
    assert list(model.ttft_ms) == [250.0]  # (1.5 - 1.0) s over 2 new requests
    assert model.last.finished() == {"length": 3}


def _top(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "serving.cli", "top", *args],
                          capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})


def test_summary_shows_the_background_compile_until_it_is_complete():
    stats = {"model": "m", "state": "ready", "compiles": 7,
             "background_compile": {"done": 3, "total": 16, "complete": False, "seconds": 4.2}}
    assert any("compiling the grid in the background  3/16 programs  4.2 s" in line
               for line in summary(stats))
    stats["background_compile"].update(done=16, complete=True)
    assert not any("background" in line for line in summary(stats))


def test_top_once_prints_a_snapshot(base_url):
    r = _top("--url", base_url, "--once")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"{MODEL}  state ready")
    assert "slots 0/8" in r.stdout


@pytest.mark.parametrize("args, code, needle", [
    (["--url", "http://127.0.0.1:9"], 1, "cannot reach http://127.0.0.1:9"),
    (["--url", "localhost:8000"], 2, "give http://HOST:PORT"),
    (["--interval", "0"], 2, "--interval"),
])
def test_top_exit_codes(args, code, needle, capsys):
    got, _, err = run_main(capsys, "top", *args)
    assert got == code and needle in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
