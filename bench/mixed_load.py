"""Mixed load over HTTP: 8 interactive streams beside one long prompt every 10 s.

Each server runs in turn on a loopback port (`metrale serve --model default --max-slots 10
--max-len 4608 --warmup full` from this checkout, and from an `--old` checkout when given;
llama.cpp's `llama-server` on the same GGUF with `-t 2 -c 41472 --parallel 9`, 4,608
positions a slot, when `--llama-server` is given). After one unmeasured short and long
request, for `--duration` seconds: 8 clients each stream short completions (64 tokens,
greedy, `ignore_eos`) one after the other, and every `--interval` seconds a prompt of about
4,000 tokens (random common words, a new order each time: no prefix cache hit) asks for one
token. Reported per server: the streams' token gaps (p50, p99, max; the gap before a stream's
first token is not one), their tokens/s together, and the long prompts' time to first token
(median, max, how many of them answered within the run). Prints one table.

    .venv/bin/python bench/mixed_load.py --duration 60 --old /tmp/old-engine \\
        --llama-server /path/to/llama-server
"""

from __future__ import annotations

import argparse
import http.client
import itertools
import json
import os
import random
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from bench.gemma3 import free_port, wait_healthy

HERE = Path(__file__).resolve().parents[1]
GGUF = HERE / "checkpoints" / "SmolLM2-135M-Instruct.Q4_1.gguf"
STREAMS = 8
MAX_LEN = 4608
WORDS = ("time", "year", "people", "way", "day", "man", "thing", "woman", "life", "child",
         "world", "school", "state", "family", "student", "group", "country", "problem", "hand",
         "part", "place", "case", "week", "company", "system", "program", "question", "work",
         "government", "number", "night", "point", "home", "water", "room", "mother", "area",
         "money", "story", "fact", "month", "lot", "right", "study", "book", "eye", "job",
         "word", "business", "issue", "side", "kind", "head", "house", "service", "friend",
         "father", "power", "hour", "game", "line", "end", "member", "law", "car", "city",
         "name", "president", "team", "minute", "idea", "kid", "body", "information", "back",
         "parent", "face", "others", "level", "office", "door", "health", "person", "art", "war",
         "history", "party", "result", "change", "morning", "reason", "research", "girl", "guy",
         "moment", "air", "teacher", "force", "education")


def server_command(name: str, root: str, port: int, args: argparse.Namespace) -> list[str]:
    """The command line of server `name` ("new", "old" or "llama-server") on `port`."""
    if name == "llama-server":
        cmd = [args.llama_server, "-m", str(GGUF), "-t", "2", "-c", str(MAX_LEN * (STREAMS + 1)),
               "--parallel", str(STREAMS + 1), "--host", "127.0.0.1", "--port", str(port)]
        return cmd + (["--no-repack"] if args.no_repack else [])
    cmd = [sys.executable, "-m", "serving.cli", "serve", "--model", "default",
           "--host", "127.0.0.1", "--port", str(port), "--max-slots", str(STREAMS + 2),
           "--max-len", str(MAX_LEN), "--warmup", "full", "--no-webui"]
    if name == "new" and args.max_itl_ms is not None:
        cmd += ["--max-itl-ms", str(args.max_itl_ms)]
    return cmd


def stream_completion(port: int, body: dict) -> list[float]:
    """POSTs a streamed /v1/completions; returns the arrival time of each chunk with text."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    conn.request("POST", "/v1/completions", json.dumps({**body, "stream": True}),
                 {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:300]!r}")
    times = []
    for raw in resp:
        line = raw.strip()
        if not line.startswith(b"data:") or line == b"data: [DONE]":
            continue
        choices = json.loads(line[5:]).get("choices") or [{}]
        if choices[0].get("text"):
            times.append(time.perf_counter())
    conn.close()
    return times


def long_prompt(rng: random.Random, words: int) -> str:
    """About `words` tokens of common words in a random order."""
    return " ".join(rng.choice(WORDS) for _ in range(words))


def run_load(port: int, duration: float, interval: float, long_words: int) -> dict:
    """The load on a ready server; returns the summary row."""
    gaps: list[float] = []
    tokens = [0]
    ttfts: list[float] = []
    lock = threading.Lock()
    end = time.perf_counter() + duration

    def client(i: int) -> None:
        k = 0
        while time.perf_counter() < end:
            body = {"prompt": f"Story {i}.{k}: once upon a time", "max_tokens": 64,
                    "temperature": 0, "ignore_eos": True}
            times = stream_completion(port, body)
            k += 1
            with lock:
                tokens[0] += len(times)
                gaps.extend(b - a for a, b in itertools.pairwise(times))

    def long_one(seed: int) -> None:
        body = {"prompt": long_prompt(random.Random(seed), long_words), "max_tokens": 1,
                "temperature": 0}
        t0 = time.perf_counter()
        times = stream_completion(port, body)
        if times and times[0] <= end + 120:
            with lock:
                ttfts.append(times[0] - t0)

    t_start = time.perf_counter()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(STREAMS)]
    for t in threads:
        t.start()
    longs = []
    n = 0
    while time.perf_counter() + 1 < end:
        time.sleep(min(interval if n else 2.0, max(0.0, end - time.perf_counter())))
        if time.perf_counter() >= end:
            break
        longs.append(threading.Thread(target=long_one, args=(1000 + n,)))
        longs[-1].start()
        n += 1
    for t in threads + longs:
        t.join()
    elapsed = time.perf_counter() - t_start
    gaps.sort()
    return {"gap_p50": statistics.median(gaps), "gap_p99": gaps[int(0.99 * (len(gaps) - 1))],
            "gap_max": gaps[-1], "tok_s": tokens[0] / elapsed,
            "ttft_median": statistics.median(ttfts) if ttfts else float("nan"),
            "ttft_max": max(ttfts) if ttfts else float("nan"), "longs": f"{len(ttfts)}/{n}"}


def measure(name: str, root: str, args: argparse.Namespace) -> dict:
    """Starts server `name`, warms it, runs the load, stops it."""
    port = free_port()
    env = dict(os.environ)
    env.setdefault("METRALE_CHECKPOINTS", str(HERE / "checkpoints"))
    env["PYTHONPATH"] = root
    log = open(f"/tmp/mixed_load-{name}.log", "ab")  # noqa: SIM115 (closed below)
    proc = subprocess.Popen(server_command(name, root, port, args), cwd=root, env=env,
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", proc, 1200)
        stream_completion(port, {"prompt": "Hello", "max_tokens": 8, "temperature": 0})
        stream_completion(port, {"prompt": long_prompt(random.Random(1), args.long_words),
                                 "max_tokens": 1, "temperature": 0})
        return run_load(port, args.duration, args.interval, args.long_words)
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--duration", type=float, default=60.0, help="seconds of load per server")
    ap.add_argument("--interval", type=float, default=10.0,
                    help="seconds between two long prompts (default 10)")
    ap.add_argument("--long-words", type=int, default=4000,
                    help="words of each long prompt (about as many tokens; default 4000)")
    ap.add_argument("--old", default=None, help="an older checkout to serve too")
    ap.add_argument("--llama-server", default=None, help="llama.cpp's llama-server binary")
    ap.add_argument("--no-repack", action="store_true", help="pass --no-repack to it")
    ap.add_argument("--max-itl-ms", type=float, default=None,
                    help="this checkout's --max-itl-ms (default: its default)")
    args = ap.parse_args()
    servers = [("new", str(HERE))]
    if args.old:
        servers.append(("old", args.old))
    if args.llama_server:
        servers.append(("llama-server", str(HERE)))
    rows = {name: measure(name, root, args) for name, root in servers}
    print(f"{STREAMS} streams of 64 tokens, one ~{args.long_words}-token prompt every "
          f"{args.interval:g} s, {args.duration:g} s per server\n")
    print("| server | stream gap p50 | p99 | max | stream tok/s | long prompt TTFT median | "
          "max | long prompts answered |\n|---|---|---|---|---|---|---|---|")
    for name, r in rows.items():
        print(f"| {name} | {r['gap_p50'] * 1e3:.0f} ms | {r['gap_p99'] * 1e3:.0f} ms | "
              f"{r['gap_max'] * 1e3:.0f} ms | {r['tok_s']:.1f} | {r['ttft_median']:.2f} s | "
              f"{r['ttft_max']:.2f} s | {r['longs']} |")


if __name__ == "__main__":
    main()
