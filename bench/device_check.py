"""The device check: one command that proves a lent TPU or GPU (or the CPU) and brings back
numbers, within about 8 minutes on one device.

    python -m bench.device_check [--out DIR] [--parts tests throughput server] [--tiny]
    make device-check                     # installs wheels/device first (docs/accelerators.md)

It first detects the backend (platform, device kind and count, JAX/jaxlib versions, plugins),
then runs the parts, each in a child process under its own time limit (one past it is
killed and reported "fail: timeout", and the check goes on):

- tests: the `accelerator` pytest marker's subset of the suite (`pytest -m accelerator`);
- throughput: decode tokens/s at batch 1/16/64 on a random model of Llama-3.2-1B's shape
  (bfloat16; float32 on CPU) with the achieved fraction of the memory bandwidth, and a
  prefill chunk's fraction of peak FLOP/s (bench/device_specs.py's table of devices);
- server: `metrale serve` on that model and `metrale bench` at 16 and 64 clients.

Each part reports pass, fail (with its error and traceback tail) or skipped (with the
reason). It writes `device_check.json` and `device_check.md` under --out (default $OUT, else
./device-check) and prints the Markdown. `--tiny` runs tiny shapes (a CPU run in a minute).
This process never imports JAX (a TPU is opened by one process at a time): the parts do.
For tests of the check: METRALE_DEVICE_CHECK_FAIL=PART makes that part raise;
METRALE_DEVICE_CHECK_REQUIRE=PART:jax.some.name makes it require a JAX API;
METRALE_DEVICE_CHECK_HANG=PART makes it wait forever (until its limit).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import signal
import subprocess
import sys
import time
import traceback
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PARTS = ("tests", "throughput", "server")
LIMITS = {"detect": 60, "tests": 150, "throughput": 150, "server": 120}
"""Seconds each part may take (480 together); --limit PART=S changes one."""
BUDGET = 480.0
FAIL_ENV = "METRALE_DEVICE_CHECK_FAIL"
REQUIRE_ENV = "METRALE_DEVICE_CHECK_REQUIRE"
HANG_ENV = "METRALE_DEVICE_CHECK_HANG"


def _tail(text: str, lines: int = 25) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])


# ---- the child: one part ------------------------------------------------------------------
def run_child(name: str, config: dict, out: Path) -> dict:
    """Runs part `name` in this process; its result dict (a raise becomes a fail)."""
    t0 = time.monotonic()
    try:
        from bench import device_parts
        from bench.device_server import server
        parts = {"detect": device_parts.detect, "tests": device_parts.tests,
                 "throughput": device_parts.throughput, "server": server}
        if os.environ.get(FAIL_ENV) == name:
            raise RuntimeError(f"injected failure ({FAIL_ENV}={name})")
        if os.environ.get(HANG_ENV) == name:  # a part that never ends: its limit stops it
            signal.pause()
        for item in filter(None, os.environ.get(REQUIRE_ENV, "").split(",")):
            part, _, api = item.partition(":")
            if part == name:
                device_parts.require(name, api)
        result = parts[name](config, out)
    except Exception as err:  # reported, never raised: the other parts still run
        message = f"{type(err).__name__}: {err}"
        if isinstance(err, AttributeError | ImportError) and "jax" in str(err).lower():
            message = f"JAX API missing or changed: {message}"
        result = {"status": "fail", "summary": message.splitlines()[0][:300], "error": message,
                  "traceback": _tail(traceback.format_exc()), "details": {}, "markdown": ""}
    result["seconds"] = round(time.monotonic() - t0, 2)
    return result


# ---- the runner ----------------------------------------------------------------------------
def run_part(name: str, config: dict, out: Path, limit: float) -> dict:
    """Runs part `name` in a child process (its own session, killed whole past `limit`
    seconds); its result, or a fail naming the timeout or the crash."""
    result_file, log = out / "parts" / f"{name}.json", out / "logs" / f"{name}.log"
    result_file.unlink(missing_ok=True)
    (out / "parts" / "config.json").write_text(json.dumps({**config, "limit": limit}))
    cmd = [sys.executable, "-m", "bench.device_check", "--child", name, "--out", str(out)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p), "PYTHONUNBUFFERED": "1"}
    t0 = time.monotonic()
    with log.open("w") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return {"status": "fail", "summary": f"timeout: past its limit of {limit:.0f} s",
                    "error": f"timeout: the {name} part ran past its limit of {limit:.0f} s "
                             "and was stopped", "traceback": _tail(log.read_text()),
                    "details": {}, "markdown": "", "seconds": round(time.monotonic() - t0, 2)}
        finally:
            with contextlib.suppress(ProcessLookupError):  # what it left behind (a server)
                os.killpg(proc.pid, signal.SIGKILL)
    if not result_file.is_file():
        return {"status": "fail", "summary": f"the part's process exited {rc} with no result",
                "error": f"exit status {rc}", "traceback": _tail(log.read_text()),
                "details": {}, "markdown": "", "seconds": round(time.monotonic() - t0, 2)}
    return json.loads(result_file.read_text())


def render(report: dict) -> str:
    """The report as Markdown: the backend, a table of the parts, each part's section."""
    b = report["backend"]
    lines = ["# Device check", "",
             f"{b.get('backend', '?')}: {b.get('device_count', '?')} x "
             f"{b.get('device_kind', '?')}; JAX {b.get('jax', '?')}, jaxlib {b.get('jaxlib', '?')}"
             f"; plugins: {', '.join(b.get('plugins') or []) or 'none'}; Python "
             f"{b.get('python', platform.python_version())}; {report['started']}"
             f"{'; --tiny shapes' if report['tiny'] else ''}", "",
             "| part | status | seconds | summary |", "|---|---|---:|---|"]
    for name, r in report["parts"].items():
        summary = str(r.get("summary", "")).replace("|", "/")
        lines.append(f"| {name} | {r['status']} | {r.get('seconds', 0):.1f} | {summary} |")
    for name, r in report["parts"].items():
        body = r.get("markdown") or ""
        if r["status"] == "fail" and r.get("error"):
            body += f"\n\nerror: {r['error']}\n\n```\n{r.get('traceback', '')}\n```"
        if body.strip():
            lines += ["", f"## {name}: {r['status']}", "", body.strip()]
    return "\n".join(lines) + "\n"


def run_check(args: argparse.Namespace, out: Path) -> dict:
    """Detects the backend, then runs the chosen parts in order within the budget."""
    for sub in ("parts", "logs"):
        (out / sub).mkdir(parents=True, exist_ok=True)
    limits = dict(LIMITS)
    for item in args.limit:
        part, _, secs = item.partition("=")
        if part not in limits or not secs.replace(".", "", 1).isdigit():
            raise SystemExit(f"device_check: --limit {item!r}: want PART=SECONDS, PART one of "
                             f"{', '.join(limits)}")
        limits[part] = float(secs)
    config: dict[str, Any] = {"tiny": args.tiny, "tests": args.tests,
                              "server_model": args.server_model}
    started = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    t0 = time.monotonic()
    parts: dict[str, dict] = {}
    for name in ("detect", *args.parts):
        left = args.budget - (time.monotonic() - t0)
        if left < 10:
            parts[name] = {"status": "skipped", "summary": f"the check's budget of "
                           f"{args.budget:.0f} s is spent", "seconds": 0.0}
            continue
        print(f"device_check: {name} (limit {min(limits[name], left):.0f} s)", file=sys.stderr,
              flush=True)
        parts[name] = run_part(name, config, out, min(limits[name], left))
        if name == "detect":
            config["backend"] = parts[name].get("details") or {}
    skipped = {"status": "skipped", "summary": "not in --parts", "seconds": 0.0}
    parts = {name: parts.get(name, skipped) for name in ("detect", *PARTS)}
    return {"version": 1, "started": started, "tiny": args.tiny, "host": platform.node(),
            "backend": config["backend"], "parts": parts,
            "seconds": round(time.monotonic() - t0, 1)}


def main(argv: list[str] | None = None) -> int:
    """The command line (module docstring). Exit status 1 when a part failed."""
    p = argparse.ArgumentParser(prog="python -m bench.device_check", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=None,
                   help="folder of device_check.json/.md (default $OUT, else ./device-check)")
    p.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS),
                   help="the parts to run (default all); detect always runs")
    p.add_argument("--tiny", action="store_true", help="tiny model shapes (a quick CPU run)")
    p.add_argument("--tests", nargs="+", default=None, metavar="PATH",
                   help="the tests part's selection (default: tests/, marker accelerator)")
    p.add_argument("--server-model", default=None,
                   help="the server part's --model (default: the random model it writes)")
    p.add_argument("--limit", action="append", default=[], metavar="PART=SECONDS",
                   help=f"one part's time limit (defaults {LIMITS})")
    p.add_argument("--budget", type=float, default=BUDGET,
                   help=f"seconds for the whole check (default {BUDGET:.0f})")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    out = (args.out or Path(os.environ.get("OUT") or "device-check")).resolve()
    if args.child:
        config = json.loads((out / "parts" / "config.json").read_text())
        result = run_child(args.child, config, out)
        (out / "parts" / f"{args.child}.json").write_text(json.dumps(result, indent=1,
                                                                     default=str))
        return 0
    report = run_check(args, out)
    (out / "device_check.json").write_text(json.dumps(report, indent=1, default=str))
    text = render(report)
    (out / "device_check.md").write_text(text)
    print(text)
    return 1 if any(r["status"] == "fail" for r in report["parts"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
