"""What keys, rate limits, request dumps and usage accounting cost per request.

Two HTTP servers in this process share one loaded runtime (the default model): a plain one,
and one with `--api-keys` (a key with limits it never reaches, so every check and header
runs), `--dump-requests` into a temporary folder and the per-tenant usage. The same short
requests (`metrale bench`'s client, streamed completions, ignore_eos, greedy) go to each in
turn, round after round, so both see the same machine; short outputs make the HTTP path's
share of a request as large as it gets. Prints one table: medians over rounds, and the keyed
server's figures over the plain one's.

    .venv/bin/python bench/access_overhead.py
    .venv/bin/python bench/access_overhead.py --concurrency 16 --requests 96 --rounds 5

Only 127.0.0.1 is contacted.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from serving.cli.bench_load import BenchConfig, Dist, run_level, summarize
from serving.cli.http_client import Client

KEYS = """
[[keys]]
key = "sk-bench"
name = "bench"
tenant = "bench"
requests_per_minute = 1000000
tokens_per_minute = 1000000000
max_concurrent_requests = 10000
daily_tokens = 1000000000000
"""

METRICS = ("req_s", "e2e_p50", "ttft_p50", "output_tok_s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--requests", type=int, default=64, help="requests per server per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt-len", type=int, default=20, help="prompt words")
    ap.add_argument("--output-len", type=int, default=4, help="tokens per answer")
    ap.add_argument("--max-slots", type=int, default=16)
    ap.add_argument("--max-len", type=int, default=512)
    args = ap.parse_args()
    # heavy imports after parsing: --help starts at once
    from serving.http.server import ServerThread
    from serving.http.settings import ServerSettings
    settings = ServerSettings(model="default", port=0, max_slots=args.max_slots,
                              max_len=args.max_len, max_waiting=4096,
                              request_timeout=3600.0)
    plain = ServerThread(settings).start()
    assert plain.wait_ready(timeout=1800), "the server did not become ready"
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "keys.toml").write_text(KEYS)
        keyed_settings = dataclasses.replace(settings, api_keys_file=f"{tmp}/keys.toml",
                                             dump_requests=f"{tmp}/dumps")
        keyed = ServerThread(keyed_settings, runtime=plain.state.runtime).start()
        assert keyed.wait_ready(timeout=60)
        cfg = BenchConfig(model=Client(plain.url).first_model(), endpoint="completions",
                          prompt_len=Dist("fixed", args.prompt_len),
                          output_len=Dist("fixed", args.output_len))
        clients = {"plain": Client(plain.url, timeout=3600),
                   "keys + limits + dumps": Client(keyed.url, api_key="sk-bench",
                                                   timeout=3600)}
        run_level(clients["plain"], cfg, args.concurrency, args.concurrency)  # warm caches
        rows: dict[str, list[dict]] = {name: [] for name in clients}
        for r in range(args.rounds):
            order = list(clients) if r % 2 == 0 else list(reversed(clients))
            for name in order:
                row = summarize(run_level(clients[name], cfg, args.concurrency,
                                          args.requests))
                assert row["failed"] == 0, row
                rows[name].append(row)
            print(f"round {r + 1} done", file=sys.stderr, flush=True)
        keyed.state.dumper.flush()
        written = keyed.state.dumper.written
        keyed.stop()
    plain.stop()
    med = {name: {m: statistics.median(r[m] for r in rs) for m in METRICS}
           for name, rs in rows.items()}
    print(f"{args.concurrency} clients, {args.requests} requests per server per round, "
          f"{args.rounds} rounds (medians); {written} dump lines written")
    print("| server | requests/s | e2e p50 ms | TTFT p50 ms | out tok/s |\n|---|---|---|---|---|")
    for name, m in med.items():
        print(f"| {name} | {m['req_s']:.1f} | {m['e2e_p50'] * 1e3:.0f} | "
              f"{m['ttft_p50'] * 1e3:.0f} | {m['output_tok_s']:.1f} |")
    a, b = med["plain"], med["keys + limits + dumps"]
    print(f"| ratio (keyed / plain) | {b['req_s'] / a['req_s']:.2f}x | "
          f"{b['e2e_p50'] / a['e2e_p50']:.2f}x | {b['ttft_p50'] / a['ttft_p50']:.2f}x | "
          f"{b['output_tok_s'] / a['output_tok_s']:.2f}x |")


if __name__ == "__main__":
    main()
