"""Decode and prompt speed of the default model for source trees side by side.

Each measurement runs in a child process whose `metrale_jax` comes from one tree (`--tree`,
e.g. a worktree of an older commit and this checkout), the trees alternating round by round,
each with its own compilation cache folder (the first round fills it). A child loads the
default model (`--quantization`: none, int8, int8-all, int4), builds an engine of 16 slots
over 2,304 positions with 512-token chunks, compiles its grid, then measures:
- decode tokens/s with 1 and 16 streams (every row decoding, `--steps` timed steps after two
  warm-up steps);
- prompt tokens/s of one 512-token and one 2,048-token prompt (`Engine.add`, which prefills
  in 512-token chunks; after one warm-up prompt of the same length).

    python bench/speed_pair.py --tree /path/to/old-worktree --tree . --rounds 3

Prints one markdown table: the median of the rounds per tree, and new / old (the last tree
over the first).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SHAPES = dict(max_slots=16, max_len=2304, max_prefill_len=512)
PROMPTS = (512, 2048)
STREAMS = (1, 16)


def child(quantization: str | None, steps: int, cache: str) -> dict[str, float]:
    """The measurements of one tree (run in the child process)."""
    import jax
    import numpy as np

    from metrale_jax.engine import Engine, EngineConfig, SlotSettings
    from metrale_jax.weights.checkpoint import load_checkpoint

    ckpt = load_checkpoint("default", None, quantization=quantization)
    engine = Engine(ckpt.config, ckpt.graphdef, ckpt.params,
                    EngineConfig(**SHAPES, quantization=quantization,
                                 compilation_cache_dir=cache))
    engine.warmup()
    out: dict[str, float] = {}
    for n in STREAMS:
        state = engine.init_decode_state()
        state, _ = engine.add(state, [(s, [1 + s] * 16, SlotSettings()) for s in range(n)])
        active = np.arange(engine.config.max_slots) < n
        for _ in range(2):
            state, res = engine.step(state, active)
        jax.block_until_ready(res.tokens)
        t0 = time.perf_counter()
        for _ in range(steps):
            state, res = engine.step(state, active)
        jax.block_until_ready(res.tokens)
        out[f"decode tok/s, {n} stream{'s' if n > 1 else ''}"] = (
            n * steps / (time.perf_counter() - t0))
    for length in PROMPTS:
        prompt = [(7 * i) % 1000 + 1 for i in range(length)]
        state = engine.init_decode_state()
        for timed in (False, True):
            t0 = time.perf_counter()
            state, first = engine.add(state, [(0, prompt, SlotSettings())])
            np.asarray(first.tokens)
            if timed:
                out[f"prompt tok/s, {length} tokens"] = length / (time.perf_counter() - t0)
    return out


def main() -> None:
    """Runs the children, trees alternating, and prints the table."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tree", action="append", required=True,
                   help="a source tree (repeat: the first is the baseline)")
    p.add_argument("--quantization", default="none,int8-all,int4",
                   help="comma-separated: none, int8, int8-all, int4")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=32, help="timed decode steps")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--cache", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child is not None:
        quant = None if args.child == "none" else args.child
        print(json.dumps(child(quant, args.steps, args.cache)))
        return
    trees = [str(Path(t).resolve()) for t in args.tree]
    caches = {t: tempfile.mkdtemp(prefix="speed-pair-") for t in trees}
    results: dict[tuple[str, str], list[dict[str, float]]] = {}
    for r in range(args.rounds):
        for quant in args.quantization.split(","):
            for tree in (trees if r % 2 == 0 else trees[::-1]):
                env = {**os.environ, "PYTHONPATH": tree}
                proc = subprocess.run(
                    [sys.executable, str(Path(__file__).resolve()), "--tree", tree,
                     "--child", quant, "--steps", str(args.steps), "--cache", caches[tree]],
                    cwd=tree, env=env, capture_output=True, text=True, check=False)
                if proc.returncode != 0:
                    sys.exit(f"{tree} ({quant}) failed:\n{proc.stderr[-3000:]}")
                results.setdefault((tree, quant), []).append(
                    json.loads(proc.stdout.strip().splitlines()[-1]))
                print(f"round {r + 1}: {quant} {tree} done", file=sys.stderr, flush=True)
    names = list(next(iter(results.values()))[0])
    print("| weights | measurement | " + " | ".join(trees) + " | last / first |")
    print("|---|---|" + "---|" * len(trees) + "---|")
    for quant in args.quantization.split(","):
        for name in names:
            meds = [statistics.median(run[name] for run in results[(t, quant)])
                    for t in trees]
            cells = " | ".join(f"{m:.1f}" for m in meds)
            print(f"| {quant} | {name} | {cells} | {meds[-1] / meds[0]:.3f} |")


if __name__ == "__main__":
    main()
