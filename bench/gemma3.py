"""Gemma 3 270M (`metrale pull gemma3-270m`): speed beside llama.cpp's server, and the memory
of a long conversation with and without the sliding layers' rings.

    python bench/gemma3.py speed --llama-server PATH/llama-server [--rounds 2]
    python bench/gemma3.py memory [--tokens 8192]

`speed` serves the same GGUF with `llama-server` (`-t 2 -c 4096 --parallel 16`, `--no-repack`
where asked: a CPU that reports AMX its VM does not enable dies of SIGILL in llama.cpp's
repacked path) and with `metrale serve` as float32, int8-all and int4 (`--max-slots 16
--max-len 1024`, prompt lookup off), one server alive at a time, in alternating orders over
`--rounds`; each is driven by `metrale bench` (completions, prompt 128 tokens, output 128, 4
requests at 1 stream and 16 at 16 streams) and the table shows TTFT and TPOT p50, tokens/s per
request at one stream and aggregate tokens/s at 16. Only loopback addresses are used.

`memory` runs one conversation of `--tokens` positions (prompt plus a short answer) through
`LLM("gemma3-270m", max_slots=1, max_len=tokens + 256)` with `sliding_cache` "window" and
"full", each in a fresh process, and prints the KV pools' bytes (the global layers' pages and
the sliding layers' rings or pages) and the process's peak RSS.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout

SERVERS = ("llama-server", "float32", "int8-all", "int4")


def free_port() -> int:
    """A free loopback TCP port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float) -> None:
    """Waits for `url/health` to answer 200 (raises if `proc` dies or time runs out)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} not healthy after {timeout:.0f} s")


def server_command(name: str, gguf: Path, port: int, args: argparse.Namespace) -> list[str]:
    """The command line of server `name` (one of SERVERS) on `port`."""
    if name == "llama-server":
        cmd = [args.llama_server, "-m", str(gguf), "-t", "2", "-c", "4096", "--parallel", "16",
               "--host", "127.0.0.1", "--port", str(port)]
        return cmd + (["--no-repack"] if args.no_repack else [])
    cmd = [sys.executable, "-m", "serving.cli", "serve", "--model", "gemma3-270m",
           "--host", "127.0.0.1", "--port", str(port), "--max-slots", "16",
           "--max-len", "1024", "--warmup", "full", "--speculative-tokens", "0"]
    return cmd + ([] if name == "float32" else ["--quantization", name])


def measure(name: str, gguf: Path, args: argparse.Namespace, out_dir: Path) -> dict:
    """Serves with `name`, runs the two levels, returns {level: summary row}."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = (out_dir / f"{name}.log").open("ab")
    proc = subprocess.Popen(server_command(name, gguf, port, args), stdout=log,
                            stderr=subprocess.STDOUT, cwd=ROOT)
    rows = {}
    try:
        wait_healthy(url, proc, 900)
        for level, requests in ((1, 4), (16, 16)):
            out = out_dir / f"{name}-{level}.json"
            subprocess.run([sys.executable, "-m", "serving.cli", "bench", "--url", url,
                            "--concurrency", str(level), "--requests", str(requests),
                            "--prompt-len", "128", "--output-len", "128", "--out", str(out)],
                           check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
            rows[level] = json.loads(out.read_text())["levels"][0]["summary"]
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
    return rows


def speed(args: argparse.Namespace) -> int:
    """The `speed` table (see the module docstring)."""
    from metrale_jax.weights.default_model import model_path
    gguf = model_path("gemma3-270m")
    names = [n for n in SERVERS if n in args.servers]
    results: dict[str, list[dict]] = {n: [] for n in names}
    with tempfile.TemporaryDirectory(prefix="bench-gemma3-") as tmp:
        for r in range(args.rounds):
            for name in (names if r % 2 == 0 else names[::-1]):
                print(f"round {r + 1}: {name}", file=sys.stderr)
                results[name].append(measure(name, gguf, args, Path(tmp)))

    def cells(rows: list[dict], level: int, key: str, scale: float, fmt: str) -> str:
        return " / ".join(format(row[level][key] * scale, fmt) for row in rows)

    print("| server | 1 stream: TTFT p50 ms | 1 stream: TPOT p50 ms | 1 stream: tok/s per "
          "request | 16 streams: TPOT p50 ms | 16 streams: aggregate tok/s |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, rows in results.items():
        label = "llama-server, Q4_K_M" if name == "llama-server" else f"metrale, {name}"
        print(f"| {label} | {cells(rows, 1, 'ttft_p50', 1e3, '.0f')} | "
              f"{cells(rows, 1, 'tpot_p50', 1e3, '.1f')} | {cells(rows, 1, 'tok_s_p50', 1, '.1f')}"
              f" | {cells(rows, 16, 'tpot_p50', 1e3, '.1f')} | "
              f"{cells(rows, 16, 'output_tok_s', 1, '.1f')} |")
    print("(one value per round, rounds in alternating server order)")
    return 0


MEMORY_CHILD = """
import json, resource, sys
import numpy as np
from metrale_jax import LLM, SamplingParams
tokens, cache = int(sys.argv[1]), sys.argv[2]
llm = LLM("gemma3-270m", max_slots=1, max_len=tokens + 256, sliding_cache=cache,
          max_prefill_len=512)
rng = np.random.default_rng(0)
prompt = [2, *rng.integers(1000, 200000, tokens - 32).tolist()]
llm.generate([prompt], SamplingParams(max_tokens=32, ignore_eos=True, temperature=0))
import jax
pools = llm.scheduler.state.pages
def nbytes(tree):
    return sum(a.nbytes for a in jax.tree.leaves(tree))
if hasattr(pools, "window"):
    full, window = nbytes(pools.full), nbytes(pools.window)
else:
    kinds = llm.checkpoint.config.layer_is_sliding
    pools = list(pools) if isinstance(pools, tuple) else [pools]
    full = sum(p.nbytes for p, s in zip(pools, kinds) if not s)
    window = sum(p.nbytes for p, s in zip(pools, kinds) if s)
print(json.dumps({"global": full, "sliding": window,
                  "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def memory(args: argparse.Namespace) -> int:
    """The `memory` table (see the module docstring)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    print("| sliding layers' cache | global layers' pages | sliding layers' KV | peak RSS |\n"
          "| --- | --- | --- | --- |")
    for cache in ("window", "full"):
        out = subprocess.run([sys.executable, "-c", MEMORY_CHILD, str(args.tokens), cache],
                             capture_output=True, text=True, env=env, cwd=ROOT, check=True)
        row = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"| {cache} | {row['global'] / 2**20:.0f} MiB | {row['sliding'] / 2**20:.0f} MiB "
              f"| {row['rss_mb']:.0f} MB |")
    print(f"({args.tokens}-position conversation, float32, one slot of max_len "
          f"{args.tokens + 256})")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Parses the command line and runs `speed` or `memory`."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    s = sub.add_parser("speed")
    s.add_argument("--llama-server", required=True, help="path of a built llama-server")
    s.add_argument("--no-repack", action="store_true", help="pass --no-repack to llama-server")
    s.add_argument("--rounds", type=int, default=2)
    s.add_argument("--servers", nargs="+", default=list(SERVERS), choices=SERVERS)
    m = sub.add_parser("memory")
    m.add_argument("--tokens", type=int, default=8192)
    args = parser.parse_args(argv)
    return speed(args) if args.what == "speed" else memory(args)


if __name__ == "__main__":
    sys.exit(main())
