"""Where the server loses its engine's speed: one workload through the batching loop in
process, then through `metrale serve` over HTTP, side by side, with CPU seconds per thread.

The same requests (the prompts `metrale bench` sends: `--prompt-len` words, `--output-len`
tokens, ignore_eos, greedy) run (1) in process: client threads submit straight to the
scheduler of an `LLM` on the default model; (2) against a `metrale serve` subprocess with
the same engine settings, through `metrale bench`'s client (streaming completions), the two
alternating level by level. During each server run the server's CPU seconds are read per
thread from /proc: XLA's compute threads against the Python threads (HTTP, event loop,
batching loop), with the client process's CPU beside them. Prints one table.

    .venv/bin/python bench/server_overhead.py                       # 4 and 16 clients
    .venv/bin/python bench/server_overhead.py --concurrency 16 --per-client 2

Only 127.0.0.1 is contacted. Linux only (/proc).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.paged_server import start_server
from serving.cli.bench_load import (
    BenchConfig,
    Dist,
    LevelResult,
    RequestResult,
    make_prompt,
    plan,
    run_level,
    summarize,
)
from serving.cli.http_client import Client


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds so far of each thread of `pid`, keyed `name:tid`."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                stat = f.read()
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                name = f.read().strip()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        out[f"{name}:{tid}"] = (int(fields[11]) + int(fields[12])) / tick
    return out


def split_cpu(before: dict[str, float], after: dict[str, float]) -> tuple[float, float]:
    """(XLA compute threads, everything else) CPU seconds between two `thread_cpu` reads."""
    xla = other = 0.0
    for key, cpu in after.items():
        used = cpu - before.get(key, 0.0)
        if key.startswith(("tf_", "XLA")):
            xla += used
        else:
            other += used
    return xla, other


def in_process(llm, cfg: BenchConfig, level: int, requests: int) -> dict:
    """The level's requests submitted straight to the scheduler by `level` threads."""
    # JAX loads only for the in-process case (the HTTP cases run the server in a child)
    from metrale_jax.scheduler import GenerationRequest, SamplingParams
    from metrale_jax.scheduler.events import Finished, Token
    todo = plan(cfg, requests, level)
    prompts = {r.index: llm._encode(make_prompt(r.prompt_words, r.index))
               for r in todo}

    def one(r: RequestResult) -> RequestResult:
        params = SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True)
        start = time.perf_counter()
        r.start = start - t0
        handle = llm.scheduler.submit(GenerationRequest.make(prompts[r.index], params))
        first = last = None
        for event in handle:
            if isinstance(event, Token) and event.token_ids:
                last = time.perf_counter()
                first = first or last
                r.output_tokens += len(event.token_ids)
            elif isinstance(event, Finished):
                r.ok = True
        end = time.perf_counter()
        r.prompt_tokens = len(prompts[r.index])
        r.e2e = end - start
        if first is not None:
            r.ttft = first - start
            if r.output_tokens > 1:
                r.tpot = (last - first) / (r.output_tokens - 1)
        return r

    t0 = time.perf_counter()
    with ThreadPoolExecutor(level) as pool:
        results = list(pool.map(one, todo))
    return summarize(LevelResult(level, time.perf_counter() - t0, results))


def over_http(url: str, pid: int, cfg: BenchConfig, level: int, requests: int) -> dict:
    """The level's requests through the server; adds the server's and client's CPU."""
    before, client0, t0 = thread_cpu(pid), time.process_time(), time.perf_counter()
    row = summarize(run_level(Client(url, timeout=3600), cfg, level, requests))
    wall = time.perf_counter() - t0
    xla, other = split_cpu(before, thread_cpu(pid))
    row.update(xla_cores=xla / wall, python_cores=other / wall,
               client_cores=(time.process_time() - client0) / wall)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[4, 16])
    ap.add_argument("--per-client", type=int, default=3, help="requests per client per level")
    ap.add_argument("--prompt-len", type=int, default=100)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--max-slots", type=int, default=16)
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--start-timeout", type=float, default=1800.0)
    args = ap.parse_args()
    # heavy imports after parsing: --help starts at once
    from metrale_jax import LLM
    llm = LLM("default", max_slots=args.max_slots, max_len=args.max_len, warmup=True)
    llm.scheduler  # noqa: B018 - builds and warms the batching loop now
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        proc, url = start_server(str(Path(__file__).resolve().parents[1]), args,
                                 f"{tmp}/server.log")
        try:
            cfg = BenchConfig(model=Client(url).first_model(), endpoint="completions",
                              prompt_len=Dist("fixed", args.prompt_len),
                              output_len=Dist("fixed", args.output_len))
            for level in args.concurrency:
                requests = level * args.per_client
                engine = in_process(llm, cfg, level, requests)
                server = over_http(url, proc.pid, cfg, level, requests)
                rows.append((level, engine, server))
                print(f"level {level} done", file=sys.stderr, flush=True)
        finally:
            proc.terminate()
            proc.wait(timeout=60)
            llm.close()
    print("| clients | path | out tok/s | TTFT p50 s | TPOT p50 / p99 ms | server CPU: XLA / "
          "Python threads (cores) | client CPU (cores) |\n|---|---|---|---|---|---|---|")
    for level, engine, server in rows:
        for name, r in (("in process", engine), ("HTTP server", server)):
            cpu = (f"{r['xla_cores']:.2f} / {r['python_cores']:.2f}" if "xla_cores" in r
                   else "")
            client = f"{r['client_cores']:.2f}" if "client_cores" in r else ""
            print(f"| {level} | {name} | {r['output_tok_s']:.1f} | {r['ttft_p50']:.2f} | "
                  f"{r['tpot_p50'] * 1e3:.0f} / {r['tpot_p99'] * 1e3:.0f} | {cpu} | {client} |")
        ratio = server["output_tok_s"] / engine["output_tok_s"]
        print(f"| {level} | server / in process | {ratio:.2f}x | | | | |")


if __name__ == "__main__":
    main()
