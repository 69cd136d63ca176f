"""A prefill chunk's attention to its context on CPU: XLA's item loop against the C++ kernel.

Two cases, each printing one table:

    .venv/bin/python bench/chunk_attention.py --cases micro
    .venv/bin/python bench/chunk_attention.py --cases prefill --rounds 2

`micro`: `models.paged_attention.chunk_attention` alone, jitted, on the default model's
attention shape (9 query heads, 3 kv heads, head dim 64, pages of 16, float32; a layer of
30), ms per call for chunks of 512 tokens: (a) one piece after 0 / 2,000 / 7,500 positions of
context, (b) 8 pieces of 64 after 800 each, (c) 16 pieces of 32 after 1,000 each; then the
pool stored int8 (`models/kv_quant.py`) and a 4,096-position sliding window for case (a) at
7,500. Variants, interleaved round by round (medians): XLA's item loop (`kernel=False`, what
the commit before ran), the kernel (`kernels/chunk_attention.py`) at its default query tile
and at `--tiles`. GFLOP/s counts 4 H D FLOPs per visible (query, key)
pair (scores and weighted sum); "matmul" is a plain `[512, 576] x [576, n]` float32 product
of the same FLOPs, measured in the same rounds, the efficiency to compare with.

`prefill`: the default model (`LLM("default", max_len=8192, max_prefill_len=512)`), one
prompt of 512 and of 8,000 random tokens, `max_tokens=1`, prompt tokens per second (time to
the first token), with nothing decoding. The step budget (`engine.step_cost.budget`) is
lifted so that every chunk stays 512 tokens (a long prompt's later pieces otherwise shrink as
their context grows: that part of the gap belongs to the step-time model). Each variant runs
in a child process (`METRALE_CHUNK_ATTENTION_KERNEL=0`: XLA's loop, else the kernel), the two
alternating, `--rounds` times; medians.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
H, K, D, PS = 9, 3, 64, 16


def _layout(pieces: list[tuple[int, int]], C: int = 512):
    """Chunk arrays for pieces of (length, context): rows 0.., each piece's positions
    ctx .. ctx + length - 1, padding after. Returns (tok_seq, tok_pos, table, N, pairs)
    where pairs counts the visible (query, key) pairs."""
    import numpy as np

    seq, pos, pairs = [], [], 0
    for row, (n, ctx) in enumerate(pieces):
        seq += [row] * n
        pos += list(range(ctx, ctx + n))
        pairs += n * ctx + n * (n + 1) // 2
    seq += [-1] * (C - len(seq))
    pos += [0] * (C - len(pos))
    pps = max(-(-(ctx + n) // PS) for n, ctx in pieces)
    table = 1 + np.arange(len(pieces) * pps).reshape(len(pieces), pps)
    return (np.asarray(seq, np.int32), np.asarray(pos, np.int32), table.astype(np.int32),
            1 + len(pieces) * pps, pairs)


def micro(args) -> None:
    """Prints the micro-benchmark's table: ms per call of each variant."""
    import functools

    import jax
    import jax.numpy as jnp
    import numpy as np

    from metrale_jax.kernels import chunk_attention as kernel
    from metrale_jax.models.kv_quant import quantize_rows
    from metrale_jax.models.paged_attention import chunk_attention

    assert kernel.available(), "the kernel did not build"
    cases = [("(a) 1 x 512 after 0", [(512, 0)], None, False),
             ("(a) 1 x 512 after 2,000", [(512, 2000)], None, False),
             ("(a) 1 x 512 after 7,500", [(512, 7500)], None, False),
             ("(b) 8 x 64 after 800", [(64, 800)] * 8, None, False),
             ("(c) 16 x 32 after 1,000", [(32, 1000)] * 16, None, False),
             ("(a) 7,500, int8 KV", [(512, 7500)], None, True),
             ("(a) 7,500, window 4,096", [(512, 7500)], 4096, False)]
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((512, 576)), jnp.float32)
    tiles = [kernel.Q_TILE] + [t for t in args.tiles if t != kernel.Q_TILE]
    print(f"| case | XLA loop ms | kernel ms (tile {kernel.Q_TILE}) | "
          + " | ".join(f"tile {t} ms" for t in tiles[1:])
          + " | XLA/kernel | XLA GFLOP/s | kernel GFLOP/s | matmul GFLOP/s |")
    print("|---" * (8 + len(tiles) - 1) + "|")
    for name, pieces, window, int8 in cases:
        seq, pos, table, N, pairs = _layout(pieces)
        window_pairs = pairs
        if window is not None:  # each query sees at most `window` keys
            window_pairs = sum(min(int(p) + 1, window) for p, s in zip(pos, seq, strict=True)
                               if s >= 0)
        flops = 4 * H * D * window_pairs
        q = jnp.asarray(rng.standard_normal((512, H, D)), jnp.float32)
        k = jnp.asarray(rng.standard_normal((512, K, D)), jnp.float32)
        v = jnp.asarray(rng.standard_normal((512, K, D)), jnp.float32)
        pages = jnp.asarray(rng.standard_normal((N, PS, 2 * K, D)), jnp.float32)
        if int8:
            pages = quantize_rows(pages)
        common = dict(sm_scale=D ** -0.5, sliding_window=window, soft_cap=None)
        fns = {"xla": jax.jit(functools.partial(chunk_attention, kernel=False, **common))}
        for t in tiles:
            fns[t] = jax.jit(functools.partial(kernel.chunk_attention, q_tile=t, **common))
        n_mm = max(1, round(flops / (2 * 512 * 576)))
        w = jnp.asarray(rng.standard_normal((576, n_mm)), jnp.float32)
        fns["matmul"] = jax.jit(lambda a, b: a @ b)
        argv = (q, k, v, jnp.asarray(seq), jnp.asarray(pos), pages, jnp.asarray(table))
        times: dict = {key: [] for key in fns}
        for key, fn in fns.items():  # compile, and check the kernel against XLA's loop
            out = fn(x, w) if key == "matmul" else fn(*argv)
            jax.block_until_ready(out)
        ref = np.asarray(fns["xla"](*argv))
        got = np.asarray(fns[kernel.Q_TILE](*argv))
        real = seq >= 0
        err = np.abs(got[real] - ref[real]).max() / np.abs(ref[real]).max()
        assert err < 1e-5, f"{name}: kernel differs from XLA's loop by {err:.2e}"
        for _ in range(args.repeats):
            for key, fn in fns.items():
                a = (x, w) if key == "matmul" else argv
                t0 = time.perf_counter()
                jax.block_until_ready(fn(*a))
                times[key].append(time.perf_counter() - t0)
        ms = {key: 1e3 * statistics.median(v) for key, v in times.items()}
        gf = {key: flops / (m * 1e6) for key, m in ms.items()}
        mm_gf = 2 * 512 * 576 * n_mm / (ms["matmul"] * 1e6)
        print(f"| {name} | {ms['xla']:.1f} | {ms[tiles[0]]:.1f} | "
              + " | ".join(f"{ms[t]:.1f}" for t in tiles[1:])
              + f" | {ms['xla'] / ms[tiles[0]]:.1f}x | {gf['xla']:.0f} | {gf[tiles[0]]:.0f} | "
              f"{mm_gf:.0f} |", flush=True)


def prefill_child(args) -> None:
    """One variant's prefill timings, printed as JSON: {length: seconds to the first token}."""
    import numpy as np

    from metrale_jax.llm import LLM
    from metrale_jax.scheduler import SamplingParams

    llm = LLM("default", max_slots=2, max_len=8192, max_prefill_len=512)
    cost = getattr(llm.scheduler.engine, "step_cost", None)
    if hasattr(cost, "budget"):  # every chunk 512 tokens
        cost.budget = float("inf")
    rng = np.random.default_rng(0)
    sp = SamplingParams(max_tokens=1, temperature=0.0)
    out = {}
    for n in args.lengths:
        llm.generate([int(t) for t in rng.integers(100, 20000, n)], sp)  # compile, warm
        t0 = time.perf_counter()
        llm.generate([int(t) for t in rng.integers(100, 20000, n)], sp)
        out[n] = time.perf_counter() - t0
    print(json.dumps(out))


def prefill(args) -> None:
    """Prints the prefill table: prompt tok/s, XLA's loop against the kernel."""
    runs: dict[str, list[dict]] = {"xla": [], "kernel": []}
    for _ in range(args.rounds):
        for variant in runs:
            env = dict(os.environ, PYTHONPATH=str(HERE),
                       METRALE_CHUNK_ATTENTION_KERNEL="0" if variant == "xla" else "1")
            proc = subprocess.run(
                [sys.executable, __file__, "--cases", "prefill-child", "--lengths",
                 *map(str, args.lengths)], env=env, capture_output=True, text=True, check=False)
            if proc.returncode:
                raise SystemExit(proc.stderr[-3000:])
            runs[variant].append(json.loads(proc.stdout.strip().splitlines()[-1]))
    print("| prompt tokens | XLA loop tok/s | kernel tok/s | kernel/XLA |")
    print("|---|---|---|---|")
    rate = {}
    for n in args.lengths:
        rate[n] = {v: n / statistics.median(r[str(n)] for r in rs) for v, rs in runs.items()}
        print(f"| {n:,} | {rate[n]['xla']:.0f} | {rate[n]['kernel']:.0f} | "
              f"{rate[n]['kernel'] / rate[n]['xla']:.2f}x |")
    lo, hi = min(args.lengths), max(args.lengths)
    for v in runs:
        print(f"{v}: {hi:,} tokens at {rate[hi][v] / rate[lo][v]:.2f}x the {lo}-token rate")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", nargs="+", default=["micro", "prefill"],
                    choices=["micro", "prefill", "prefill-child"])
    ap.add_argument("--repeats", type=int, default=5, help="micro: timed calls per variant")
    ap.add_argument("--tiles", type=int, nargs="*", default=[16, 64],
                    help="micro: further query tiles of the kernel")
    ap.add_argument("--rounds", type=int, default=2, help="prefill: child processes each")
    ap.add_argument("--lengths", type=int, nargs="+", default=[512, 8000])
    args = ap.parse_args()
    sys.path.insert(0, str(HERE))
    for case in args.cases:
        {"micro": micro, "prefill": prefill, "prefill-child": prefill_child}[case](args)


if __name__ == "__main__":
    main()
