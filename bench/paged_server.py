"""The server on the paged engine beside a server on an older commit's engine, under load.

Starts `metrale serve` (the default model) from this checkout and from an older one (a git
worktree), both on loopback ports with the same flags, and runs `metrale bench` against each,
the two servers alternating level by level (this machine's noise hits both alike). Streaming
chat, prompts uniform in 64-1024 words, 128 output tokens (ignore_eos). Prints one table.

    git worktree add /tmp/old-engine fdb1871      # the contiguous-cache engine
    .venv/bin/python bench/paged_server.py --old /tmp/old-engine
    .venv/bin/python bench/paged_server.py --old /tmp/old-engine --concurrency 1 8 --per-client 2

Only 127.0.0.1 is contacted.
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

HERE = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(root: str, args, log_path: str,
                 extra: list[str] | None = None) -> tuple[subprocess.Popen, str]:
    """`metrale serve` from checkout `root` on a free loopback port (with `extra` flags);
    waits until it answers."""
    port = _free_port()
    cmd = [sys.executable, "-m", "serving.cli", "serve", "--host", "127.0.0.1",
           "--port", str(port), "--max-slots", str(args.max_slots), "--max-len",
           str(args.max_len), "--max-waiting", "1024", "--request-timeout", "3600",
           *(extra or [])]
    # Both checkouts serve this checkout's pulled default model.
    env = dict(os.environ, PYTHONPATH=root)
    env.setdefault("METRALE_CHECKPOINTS", str(HERE / "checkpoints"))
    log = open(log_path, "w")  # noqa: SIM115 - lives as long as the server
    proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + args.start_timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server in {root} exited; see {log_path}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    return proc, url
        except OSError:
            pass
        time.sleep(1.0)
    proc.kill()
    raise SystemExit(f"server in {root} did not become ready; see {log_path}")


def run_level(url: str, level: int, args, out: str) -> dict:
    """One `metrale bench` level against `url`; returns its summary row."""
    cmd = [sys.executable, "-m", "serving.cli", "bench", "--url", url, "--endpoint", "chat",
           "--concurrency", str(level), "--requests", str(max(level * args.per_client, 4)),
           "--prompt-len", args.prompt_len, "--output-len", str(args.output_len),
           "--seed", "0", "--out", out]
    subprocess.run(cmd, cwd=str(HERE), check=True, capture_output=True, text=True)
    return json.loads(Path(out).read_text())["levels"][0]["summary"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", required=True, help="checkout of the older engine (a worktree)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--per-client", type=int, default=2, help="requests per client per level")
    ap.add_argument("--prompt-len", default="64:1024")
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--max-slots", type=int, default=32)
    ap.add_argument("--max-len", type=int, default=2048)
    ap.add_argument("--start-timeout", type=float, default=1800.0)
    args = ap.parse_args()
    roots = {"old": args.old, "new": str(HERE)}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        servers = {}
        try:
            for name, root in roots.items():
                servers[name] = start_server(root, args, f"{tmp}/{name}.log")
            for level in args.concurrency:
                got = {name: run_level(url, level, args, f"{tmp}/{name}-{level}.json")
                       for name, (_, url) in servers.items()}
                rows.append((level, got))
                print(f"level {level} done", file=sys.stderr, flush=True)
        finally:
            for proc, _ in servers.values():
                proc.terminate()
                proc.wait(timeout=60)

    def cell(r: dict, key: str, scale: float = 1.0, fmt: str = ".0f") -> str:
        v = r.get(key)
        return "-" if v is None else format(v * scale, fmt)

    print("| clients | server | out tok/s | TTFT p50 / p99 s | TPOT p50 / p99 ms | failed |"
          "\n|---|---|---|---|---|---|")
    for level, got in rows:
        for name in roots:
            r = got[name]
            print(f"| {level} | {name} | {r['output_tok_s']:.1f} | "
                  f"{cell(r, 'ttft_p50', 1, '.2f')} / {cell(r, 'ttft_p99', 1, '.2f')} | "
                  f"{cell(r, 'tpot_p50', 1e3)} / {cell(r, 'tpot_p99', 1e3)} | "
                  f"{r['failed']} |")
        old, new = got["old"], got["new"]
        ratio = new["output_tok_s"] / old["output_tok_s"] if old["output_tok_s"] else 0.0
        ttft = (new["ttft_p99"] / old["ttft_p99"]
                if new.get("ttft_p99") and old.get("ttft_p99") else float("nan"))
        print(f"| {level} | new/old | {ratio:.2f}x | p99 {ttft:.2f}x | | |")


if __name__ == "__main__":
    main()
