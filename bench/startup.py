"""Start-up time and resident memory of `metrale serve` and `metrale generate`, for one or more
source trees side by side (issue 38's goals).

    python bench/startup.py --tree /work/wt/base --tree . --repeats 1
    python bench/startup.py --tree . --measure serve generate --serve-arg=--warmup=full

Each tree runs as `PYTHON -m serving.cli ...` (what the `metrale` entry point,
`serving.cli.metrale:main`, runs) with the tree as working folder and first on PYTHONPATH, and
its own fresh, empty compilation cache folder (METRALE_JAX_CACHE); then again with that cache
warm. Trees alternate run by run (the first tree rotates each repeat), so the noise of a shared
machine falls on all of them alike. Measurements (`--measure`):

- serve: `serve --model default --max-slots 16 --max-len 1024` on a free 127.0.0.1 port,
  cold then warm cache: seconds from process start to `/health` 200; seconds until the whole
  grid is compiled; resident memory (VmRSS, and the peak VmHWM) once it is; then SIGINT.
  "Grid compiled" reads `/v1/metrale/stats`' `background_compile.complete`; a server from
  before the background compile (no such field) compiles its grid before /health, so its
  grid time is its health time.
- generate: wall time of `generate --model default --prompt Hi --max-tokens 8`, cold then warm
  cache, and its peak resident memory.
- rss: `serve --model default --max-slots 4 --max-len 512` with `--quantization int4` and
  float32 (`--dtype float32`), cold then warm cache: resident memory once the grid is compiled.

`--gdb-trim` adds each server's RSS after glibc's `malloc_trim(0)`, called inside it by gdb
once the grid is compiled (what a trim after warmup would give back). `--env KEY=VALUE` sets a
variable for every run, `--tree-env N:KEY=VALUE` for the Nth tree only (give a tree twice to
compare a setting, e.g. MALLOC_ARENA_MAX).

Prints a markdown table, rows the measurements, one column a tree (the median of the repeats,
with min–max when there are several). `--json FILE` also writes every run. Only talks to
127.0.0.1; the processes' stderr goes to `--log-dir` (a temporary folder by default).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MEASUREMENTS = ("serve", "generate", "rss")
SERVE_ARGS = ("--model", "default", "--max-slots", "16", "--max-len", "1024")
RSS_ARGS = ("--model", "default", "--max-slots", "4", "--max-len", "512")
RSS_VARIANTS = {"int4": ("--quantization", "int4"), "float32": ("--dtype", "float32")}
GENERATE_ARGS = ("generate", "--model", "default", "--prompt", "Hi", "--max-tokens", "8")
POLL_S = 0.1


@dataclass
class Tree:
    """One source tree to measure: its folder, the python that runs it, its column title."""

    path: Path
    python: str
    title: str
    env: dict[str, str] = field(default_factory=dict)
    results: dict[str, list[float]] = field(default_factory=dict)

    def add(self, row: str, value: float | None) -> None:
        """Records one run's `value` (None: the run gave none) under table row `row`."""
        if value is not None:
            self.results.setdefault(row, []).append(value)


@dataclass
class ServeRun:
    """What one `metrale serve` start measured (seconds from process start, MB resident)."""

    health_s: float
    grid_s: float
    rss_mb: float
    peak_mb: float
    compiles: int | None
    trimmed_mb: float | None = None


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def proc_memory_mb(pid: int) -> tuple[float, float]:
    """(VmRSS, VmHWM) of process `pid` in MB (1e6 bytes), from /proc/PID/status."""
    values = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            values[key] = int(rest.split()[0]) * 1024 / 1e6
    return values["VmRSS"], values["VmHWM"]


def http_get(url: str) -> tuple[int, Any]:
    """(status, parsed JSON body or None) of GET `url`; (0, None) when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, None
    except (OSError, ValueError):
        return 0, None


def grid_done(stats: Any) -> bool | None:
    """Whether a stats body says the whole grid is compiled (`background_compile.complete`);
    None for a server from before the background compile (its grid is complete at /health)."""
    if isinstance(stats, dict) and isinstance(stats.get("background_compile"), dict):
        return bool(stats["background_compile"].get("complete"))
    return None


def tree_env(tree: Tree, cache: Path) -> dict[str, str]:
    """The environment of a run of `tree`: the tree first on PYTHONPATH, `cache` as the
    compilation cache folder."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(tree.path), *filter(None, [os.environ.get("PYTHONPATH")])])
    env["METRALE_JAX_CACHE"] = str(cache)
    env.pop("METRALE_TEST_JAX_CACHE", None)
    env.update(tree.env)
    return env


def stop(proc: subprocess.Popen[bytes], timeout: float = 60.0) -> None:
    """SIGINT `proc` and wait for it to exit; SIGKILL after `timeout` seconds."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def malloc_trim(pid: int) -> bool:
    """Calls glibc's malloc_trim(0) inside process `pid` through gdb (what a trim after
    warmup would give back, measured without changing the server); False if gdb failed."""
    gdb = shutil.which("gdb")
    if gdb is None:
        return False
    done = subprocess.run([gdb, "-p", str(pid), "-batch", "-nx", "-ex",
                           "call (int) malloc_trim(0)"], capture_output=True, timeout=300)
    return done.returncode == 0


def run_serve(tree: Tree, cache: Path, args: list[str], log: Path, timeout: float,
              trim: bool = False) -> ServeRun:
    """Starts `serve ARGS` of `tree` on a free port and measures it up to the compiled grid
    (trim: then its RSS after a malloc_trim(0) too); stops it. Raises RuntimeError if it
    exits or passes `timeout` seconds first."""
    port = free_port()
    cmd = [tree.python, "-m", "serving.cli", "serve", *args, "--host", "127.0.0.1",
           "--port", str(port)]
    base = f"http://127.0.0.1:{port}"
    with log.open("wb") as err:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=tree.path, env=tree_env(tree, cache),
                                stdout=subprocess.DEVNULL, stderr=err)
        try:
            health_s = grid_s = None
            stats: Any = None
            while grid_s is None:
                elapsed = time.perf_counter() - start
                if proc.poll() is not None:
                    raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}; see {log}")
                if elapsed > timeout:
                    raise RuntimeError(f"{' '.join(cmd)} not ready in {timeout:.0f} s; see {log}")
                if health_s is None and http_get(f"{base}/health")[0] == 200:
                    health_s = time.perf_counter() - start
                if health_s is not None:
                    status, stats = http_get(f"{base}/v1/metrale/stats")
                    if status == 200 and grid_done(stats) is not False:
                        grid_s = time.perf_counter() - start
                        break
                time.sleep(POLL_S)
            rss, peak = proc_memory_mb(proc.pid)
            trimmed = (proc_memory_mb(proc.pid)[0] if trim and malloc_trim(proc.pid)
                       else None)
        finally:
            stop(proc)
    compiles = stats.get("compiles") if isinstance(stats, dict) else None
    return ServeRun(health_s, grid_s, rss, peak, compiles, trimmed)


def run_generate(tree: Tree, cache: Path, log: Path) -> tuple[float, float]:
    """(wall seconds, peak resident MB) of one `generate` of `tree`. Raises RuntimeError if
    it fails."""
    cmd = [tree.python, "-m", "serving.cli", *GENERATE_ARGS]
    with log.open("wb") as err:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=tree.path, env=tree_env(tree, cache),
                                stdout=subprocess.DEVNULL, stderr=err)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - start
        proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}; see {log}")
    return wall, usage.ru_maxrss * 1024 / 1e6


class Bench:
    """Runs the measurements over the trees, each run with its own cache folder."""

    def __init__(self, trees: list[Tree], opts: argparse.Namespace) -> None:
        self.trees, self.opts = trees, opts
        self.log_dir = Path(opts.log_dir or tempfile.mkdtemp(prefix="startup-logs-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.runs: list[dict[str, Any]] = []
        self.count = 0

    def _fresh_cache(self) -> Path:
        return Path(tempfile.mkdtemp(prefix="startup-cache-", dir=self.opts.cache_root))

    def _log(self, tree: Tree, name: str) -> Path:
        self.count += 1
        safe = "".join(c if c.isalnum() else "_" for c in tree.title)
        return self.log_dir / f"{self.count:03d}-{safe}-{name}.log"

    def _record(self, tree: Tree, name: str, values: dict[str, Any]) -> None:
        self.runs.append({"tree": tree.title, "run": name, **values})
        shown = ", ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}"
                          for k, v in values.items())
        print(f"[{tree.title}] {name}: {shown}", file=sys.stderr, flush=True)

    def _rotated(self, repeat: int) -> list[Tree]:
        k = repeat % len(self.trees)
        return self.trees[k:] + self.trees[:k]

    def serve(self, tree: Tree, args: list[str], label: str, rows: bool) -> None:
        """One cold and one warm start of `serve ARGS`; rows=True records the time rows."""
        cache = self._fresh_cache()
        try:
            for temp in ("cold", "warm"):
                name = f"{label} {temp}"
                run = run_serve(tree, cache, args, self._log(tree, name), self.opts.timeout,
                                self.opts.gdb_trim)
                self._record(tree, name, vars(run))
                if rows:
                    tree.add(f"serve {temp}: /health 200 (s)", run.health_s)
                    tree.add(f"serve {temp}: grid compiled (s)", run.grid_s)
                tree.add(f"{label} {temp}: RSS at grid (MB)", run.rss_mb)
                tree.add(f"{label} {temp}: peak RSS (MB)", run.peak_mb)
                tree.add(f"{label} {temp}: RSS after malloc_trim (MB)", run.trimmed_mb)
        finally:
            shutil.rmtree(cache, ignore_errors=True)

    def generate(self, tree: Tree) -> None:
        """One cold and one warm `generate`."""
        cache = self._fresh_cache()
        try:
            for temp in ("cold", "warm"):
                wall, peak = run_generate(tree, cache, self._log(tree, f"generate {temp}"))
                self._record(tree, f"generate {temp}", {"wall_s": wall, "peak_mb": peak})
                tree.add(f"generate {temp}: wall (s)", wall)
                tree.add(f"generate {temp}: peak RSS (MB)", peak)
        finally:
            shutil.rmtree(cache, ignore_errors=True)

    def run(self) -> None:
        """Every chosen measurement, `repeats` times, the trees alternating."""
        extra = list(self.opts.serve_arg)
        for measurement in self.opts.measure:
            for repeat in range(self.opts.repeats):
                for tree in self._rotated(repeat):
                    if measurement == "serve":
                        self.serve(tree, [*SERVE_ARGS, *extra], "serve 16x1024", rows=True)
                    elif measurement == "generate":
                        self.generate(tree)
                    else:
                        for variant in self.opts.variant:
                            flags = RSS_VARIANTS[variant]
                            self.serve(tree, [*RSS_ARGS, *flags, *extra],
                                       f"serve 4x512 {variant}", rows=False)


def cell(values: list[float]) -> str:
    """A table cell: the median, with min–max when there are several values."""
    if not values:
        return "–"
    med = statistics.median(values)
    digits = 0 if med >= 100 else 1
    text = f"{med:.{digits}f}"
    if len(values) > 1:
        text += f" ({min(values):.{digits}f}–{max(values):.{digits}f})"
    return text


def table(trees: list[Tree]) -> str:
    """The markdown table: one row a measurement, one column a tree."""
    rows: list[str] = []
    for tree in trees:
        rows += [r for r in tree.results if r not in rows]
    lines = ["| measurement | " + " | ".join(t.title for t in trees) + " |",
             "|---|" + "---:|" * len(trees)]
    lines += [f"| {r} | " + " | ".join(cell(t.results.get(r, [])) for t in trees) + " |"
              for r in rows]
    return "\n".join(lines)


def git_title(path: Path) -> str:
    """A column title for the tree at `path`: its folder name and short commit (+ when
    tracked files outside checkpoints/ differ from it)."""
    try:
        commit = subprocess.run(["git", "-C", str(path), "rev-parse", "--short", "HEAD"],
                                capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return path.name
    dirty = subprocess.run(["git", "-C", str(path), "status", "--porcelain",
                            "--untracked-files=no", "--", ".", ":(exclude)checkpoints"],
                           capture_output=True, text=True).stdout  # checkpoints: symlinks
    return f"{path.name} {commit}{'+' if dirty.strip() else ''}"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tree", action="append", default=None, metavar="DIR",
                   help="a source tree to measure (repeatable; default: this checkout)")
    p.add_argument("--python", default=None,
                   help="the python to run every tree with (default: TREE/.venv/bin/python "
                        "where it exists, else this python)")
    p.add_argument("--measure", nargs="+", default=list(MEASUREMENTS), choices=MEASUREMENTS,
                   help="which measurements to run (default: all)")
    p.add_argument("--repeats", type=int, default=1, help="runs of each measurement per tree")
    p.add_argument("--serve-arg", action="append", default=[], metavar="ARG",
                   help="an extra flag for every serve run, e.g. --serve-arg=--warmup=full")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                   help="an environment variable for every run, e.g. MALLOC_ARENA_MAX=2")
    p.add_argument("--tree-env", action="append", default=[], metavar="N:KEY=VALUE",
                   help="an environment variable for the runs of the Nth --tree only (from 1; "
                        "the same tree may be given twice to compare a setting)")
    p.add_argument("--variant", nargs="+", default=list(RSS_VARIANTS), choices=RSS_VARIANTS,
                   help="rss: which weights (default: both)")
    p.add_argument("--gdb-trim", action="store_true",
                   help="serve: also the RSS after malloc_trim(0) called in the server by gdb")
    p.add_argument("--timeout", type=float, default=900.0,
                   help="seconds a server may take to compile its grid")
    p.add_argument("--cache-root", default=None,
                   help="where the fresh cache folders go (default: the temp folder)")
    p.add_argument("--log-dir", default=None, help="where the processes' stderr goes")
    p.add_argument("--json", default=None, metavar="FILE", help="also write every run here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Runs the benchmark; prints the markdown table."""
    opts = parse_args(argv)
    trees = []
    folders = opts.tree or [str(Path(__file__).resolve().parents[1])]
    for n, folder in enumerate(folders, 1):
        path = Path(folder).resolve()
        venv = path / ".venv" / "bin" / "python"
        python = opts.python or (str(venv) if venv.exists() else sys.executable)
        own = [item.split(":", 1)[1] for item in opts.tree_env if item.split(":", 1)[0] == str(n)]
        env = dict(item.split("=", 1) for item in [*opts.env, *own])
        title = " ".join([git_title(path), *own])
        trees.append(Tree(path, python, title, env))
    bench = Bench(trees, opts)
    print(f"logs: {bench.log_dir}", file=sys.stderr)
    try:
        bench.run()
    finally:
        print(table(trees))
        if opts.json:
            Path(opts.json).write_text(json.dumps(bench.runs, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
