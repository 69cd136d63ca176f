"""Time to first token of a request to a model that is not loaded (issue 42's goal: a cold
load under 5 s with a warm compile cache), against the same model's warm TTFT.

    python bench/model_swap.py                      # the default model, 5 rounds
    python bench/model_swap.py --model default --rounds 3 --cache-dir /tmp/cache

Starts `metrale serve` (as `make serve` does: `python -m serving.cli serve`) on a free
127.0.0.1 port with the model twice, `main` (loaded at start) and `other` (the same files, on
demand), `--max-loaded-models 2 --keep-alive -1`, and its compilation cache in `--cache-dir`
(default: a fresh folder, filled by a first load that is not measured; the executable store
and JAX's persistent cache as in a real deployment). Then, each round, a streamed completion
(8 tokens) to `other` in each state, timed from the request to its first token:

- warm: loaded and idle (its grid compiled: each load's background compile is waited for
  before the next step, as an idle model's would have ended);
- from disk: after `POST /v1/metrale/models/unload` (weights read again, programs from the
  cache);
- asleep, level 1: after `/sleep` level 1 (params copied back from the host, no program
  loaded or compiled);
- asleep, level 2: after `/sleep` level 2 (as from disk).

Prints a markdown table: the median TTFT (min–max) of each state and its ratio to warm, and
the load seconds the server reports. Only talks to 127.0.0.1.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    """A free TCP port on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=600) as r:
        return json.loads(r.read())


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())


def ttft(port: int, model: str) -> float:
    """Seconds from sending a streamed completion to `model` to its first token's event."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    body = json.dumps({"model": model, "prompt": "The capital of France is", "max_tokens": 8,
                       "temperature": 0, "stream": True})
    t0 = time.perf_counter()
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"{resp.status}: {resp.read()[:300]!r}")
    first = None
    for raw in resp:
        line = raw.decode().strip()
        if first is None and line.startswith("data: {"):
            first = time.perf_counter() - t0
    conn.close()
    if first is None:
        raise RuntimeError("no token came")
    return first


def wait_ready(port: int, proc: subprocess.Popen, timeout: float = 900.0) -> None:
    """Waits for /health 200 and the primary model's grid to be compiled."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            stats = get(f"http://127.0.0.1:{port}/v1/metrale/stats")
            if stats["state"] == "ready" and stats["background_compile"].get("complete", True):
                return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError("the server did not become ready")


def settle(base: str, model: str, timeout: float = 900.0) -> None:
    """Waits until `model`'s grid has compiled in the background (an idle model's state)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        row = {r["id"]: r for r in get(f"{base}/v1/metrale/models")["data"]}[model]
        if not row["programs"]["compiling"]:
            return
        time.sleep(0.5)
    raise TimeoutError(f"{model}'s grid did not finish compiling")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default", help="the model (default: the default one)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--cache-dir", default=None, help="the compilation cache (default: fresh)")
    p.add_argument("--serve-arg", action="append", default=[], help="one more serve flag")
    opts = p.parse_args(argv)
    cache = opts.cache_dir or tempfile.mkdtemp(prefix="metrale-swap-cache-")
    port = free_port()
    env = {**os.environ, "METRALE_JAX_CACHE": cache, "PYTHONPATH": str(ROOT)}
    log = open(Path(tempfile.gettempdir()) / f"model-swap-{port}.log", "wb")  # noqa: SIM115
    cmd = [sys.executable, "-m", "serving.cli", "serve", "--model", f"main={opts.model}",
           "--model", f"other={opts.model}", "--max-loaded-models", "2", "--keep-alive",
           "-1", "--port", str(port), *opts.serve_arg]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    times: dict[str, list[float]] = {}
    loads: dict[str, list[float]] = {}
    try:
        wait_ready(port, proc)
        ttft(port, "other")  # its first load fills the cache with what the primary has not
        settle(base, "other")
        ttft(port, "other")
        for _ in range(opts.rounds):
            times.setdefault("warm", []).append(ttft(port, "other"))
            for state, route, body in (
                    ("from disk", "unload", {}), ("asleep, level 1", "sleep", {"level": 1}),
                    ("asleep, level 2", "sleep", {"level": 2})):
                post(f"{base}/v1/metrale/models/{route}", {"model": "other", **body})
                times.setdefault(state, []).append(ttft(port, "other"))
                settle(base, "other")
                row = {r["id"]: r for r in get(f"{base}/v1/metrale/models")["data"]}["other"]
                loads.setdefault(state, []).append(row["load_seconds"] or 0.0)
        programs = {r["id"]: r for r in get(f"{base}/v1/metrale/models")["data"]}["other"]
    finally:
        proc.terminate()
        proc.wait(60)
        log.close()
    warm = statistics.median(times["warm"])
    print(f"model {opts.model}, {opts.rounds} rounds; programs of `other` at the end: "
          f"{programs['programs']['compiled']} ({programs['programs']['compiled_afresh']} "
          "compiled afresh)\n")
    print("| state | TTFT median (s) | min–max (s) | × warm | load / wake (s, server) |")
    print("|---|---:|---:|---:|---:|")
    for state, values in times.items():
        med = statistics.median(values)
        load = f"{statistics.median(loads[state]):.2f}" if state in loads else "-"
        print(f"| {state} | {med:.3f} | {min(values):.3f}–{max(values):.3f} | "
              f"{med / warm:.1f} | {load} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
