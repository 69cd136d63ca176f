"""`metrale bench`: load against any OpenAI-compatible URL, as a table, JSON and a plot.

    metrale bench --url http://127.0.0.1:8000 --concurrency 1 8 32 --requests 64 \\
        --prompt-len 128 --output-len 64:256 --out results.json --plot results.png

Per concurrency level it prints TTFT, TPOT and per-request throughput at p50 / p90 / p99, the
aggregate output tokens/s and requests/s. `--out` writes every request's raw timings as JSON.
The measuring lives in serving/cli/bench_load.py, the plot in serving/cli/bench_plot.py.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from metrale_jax.errors import InvalidParameterError
from serving.cli.bench_load import BenchConfig, parse_dist, run_level, summarize
from serving.cli.http_client import Client


class BenchFailedError(Exception):
    """The run could not measure anything (every request failed)."""


def parse_concurrency(values: list[str]) -> list[int]:
    """`["1", "8,32"]` -> [1, 8, 32]; each ≥ 1."""
    out = []
    for v in values:
        for part in v.split(","):
            part = part.strip()
            if not part:
                continue
            try:
                n = int(part)
            except ValueError:
                raise InvalidParameterError(f"--concurrency {part!r}: not an integer") from None
            if n < 1:
                raise InvalidParameterError(f"--concurrency {n}: must be ≥ 1")
            out.append(n)
    if not out:
        raise InvalidParameterError("--concurrency: give at least one level")
    return out


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1e3:.0f}" if v >= 0.1 else f"{v * 1e3:.1f}"


def _rate(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


def _triple(row: dict[str, Any], name: str, fmt) -> str:
    return " / ".join(fmt(row[f"{name}_p{q}"]) for q in (50, 90, 99))


HEAD = ("conc", "reqs", "fail", "TTFT ms p50/p90/p99", "TPOT ms p50/p90/p99",
        "tok/s per req p50/p90/p99", "out tok/s", "req/s")


def table_cells(rows: list[dict[str, Any]]) -> list[tuple[str, ...]]:
    """The table's cells, one tuple per level (strings)."""
    return [(str(r["concurrency"]), str(r["requests"]), str(r["failed"]),
             _triple(r, "ttft", _ms), _triple(r, "tpot", _ms), _triple(r, "tok_s", _rate),
             f"{r['output_tok_s']:.1f}", f"{r['req_s']:.2f}") for r in rows]


def render_plain(rows: list[dict[str, Any]]) -> str:
    """The summary as aligned plain text."""
    cells = table_cells(rows)
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(HEAD)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(HEAD, widths, strict=True))]
    lines.append("-" * len(lines[0]))
    lines += ["  ".join(c.rjust(w) for c, w in zip(cell, widths, strict=True)) for cell in cells]
    return "\n".join(lines)


def _print_rich(rows: list[dict[str, Any]], title: str) -> None:
    from rich.console import Console
    from rich.table import Table
    t = Table(title=title, title_justify="left")
    for h in HEAD:
        t.add_column(h, justify="right")
    for cell in table_cells(rows):
        t.add_row(*cell)
    Console().print(t)


def run_bench(client: Client, cfg: BenchConfig, levels: list[int], requests: int | None,
              progress: Any = None) -> list[dict[str, Any]]:
    """Runs every level; returns [{"summary": row, "requests": [raw result dicts]}]."""
    out = []
    for c in levels:
        n = requests or max(8, 4 * c)
        name = f"concurrency {c}: {n} requests"

        def step(done: int, total: int, name: str = name) -> None:
            if progress is not None:
                progress(name, done, total)

        step(0, n)
        level = run_level(client, cfg, c, n, on_done=step)
        out.append({"summary": summarize(level),
                    "requests": [{**vars(r), "tokens_per_s": r.tokens_per_s}
                                 for r in level.results]})
    return out


def cmd_bench(args: argparse.Namespace) -> int:
    """Runs the benchmark; prints the table; writes --out and --plot."""
    from serving.cli import bench_plot
    from serving.progress import StageProgress
    levels = parse_concurrency(args.concurrency)
    if args.requests is not None and args.requests < 1:
        raise InvalidParameterError("--requests must be ≥ 1")
    if args.plot and not bench_plot.available():
        raise InvalidParameterError("--plot needs matplotlib: pip install 'metrale-jax[plot]'")
    if args.endpoint not in ("completions", "chat"):
        raise InvalidParameterError("--endpoint must be completions or chat")
    prompt_len = parse_dist(args.prompt_len, "--prompt-len")
    output_len = parse_dist(args.output_len, "--output-len")
    client = Client(args.url, api_key=args.api_key, timeout=args.timeout)
    model = args.model or client.first_model()
    cfg = BenchConfig(model=model, endpoint=args.endpoint, stream=not args.no_stream,
                      prompt_len=prompt_len, output_len=output_len,
                      ignore_eos=not args.no_ignore_eos, temperature=args.temperature,
                      seed=args.seed)
    with StageProgress() as progress:
        results = run_bench(client, cfg, levels, args.requests, progress)
    rows = [level["summary"] for level in results]
    mode = "streaming" if cfg.stream else "not streaming"
    title = (f"{model} at {client.url}: {cfg.endpoint}, {mode}, prompt {prompt_len} words, "
             f"output {output_len} tokens")
    if sys.stdout.isatty():
        _print_rich(rows, title)
    else:
        print(title)
        print(render_plain(rows))
    if args.out:
        config = {"url": client.url, "model": model, "endpoint": cfg.endpoint,
                  "stream": cfg.stream, "prompt_len": str(prompt_len),
                  "output_len": str(output_len), "ignore_eos": cfg.ignore_eos,
                  "temperature": cfg.temperature, "seed": cfg.seed}
        Path(args.out).write_text(json.dumps({"config": config, "levels": results}, indent=2))
        print(f"metrale: raw results written to {args.out}", file=sys.stderr)
    if args.plot:
        bench_plot.plot_levels(rows, args.plot, title=f"{model}: {cfg.endpoint}")
        print(f"metrale: plot written to {args.plot}", file=sys.stderr)
    if all(r["failed"] == r["requests"] for r in rows):
        first = next(q["error"] for level in results for q in level["requests"] if q["error"])
        raise BenchFailedError(f"every request failed, e.g. {first}")
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Registers `metrale bench`."""
    p = sub.add_parser(
        "bench", help="load-test an OpenAI-compatible server",
        description="Load-test any OpenAI-compatible server: for each concurrency level, run "
                    "--requests requests with that many in flight, and print TTFT, TPOT and "
                    "per-request throughput (p50/p90/p99) with the aggregate tokens/s. Only "
                    "the URL given is contacted. Lengths take N, A:B (uniform) or "
                    "normal:MEAN:STD.")
    p.add_argument("--url", default="http://127.0.0.1:8000",
                   help="base URL of the server (default http://127.0.0.1:8000)")
    p.add_argument("--model", default=None,
                   help="model id to request (default: the first /v1/models lists)")
    p.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    p.add_argument("--concurrency", nargs="+", default=["1", "8", "32"],
                   help="clients in flight, one level or several: 1 8 32 or 1,8,32 "
                        "(default 1 8 32)")
    p.add_argument("--requests", type=int, default=None,
                   help="requests per level (default 4 x concurrency, at least 8)")
    p.add_argument("--prompt-len", default="128",
                   help="prompt length in words (~tokens): N, A:B or normal:MEAN:STD "
                        "(default 128)")
    p.add_argument("--output-len", default="128",
                   help="max_tokens of each request: N, A:B or normal:MEAN:STD (default 128)")
    p.add_argument("--endpoint", default="completions", choices=["completions", "chat"],
                   help="/v1/completions or /v1/chat/completions (default completions)")
    p.add_argument("--no-stream", action="store_true",
                   help="send non-streaming requests (TTFT and TPOT are then not measured)")
    p.add_argument("--no-ignore-eos", action="store_true",
                   help="let requests stop at end-of-sequence (by default ignore_eos is sent "
                        "so each request makes its full output length)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature of every request (default 0, greedy)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the length draws (the same seed gives the same requests)")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="seconds one request may take (default 600)")
    p.add_argument("--out", default=None, metavar="FILE.json",
                   help="write the config, summaries and every request's timings as JSON")
    p.add_argument("--plot", default=None, metavar="FILE.png",
                   help="draw throughput and latency against concurrency (needs matplotlib, "
                        "the 'plot' extra)")
    p.set_defaults(func=cmd_bench)
