"""Decode attention on XLA:CPU: what its block loop costs, and its share of a decode step.

Two cases, each printing one table:

    .venv/bin/python bench/decode_attention.py --cases micro
    .venv/bin/python bench/decode_attention.py --cases engine --rounds 2

`micro`: `decode_attention` alone, jitted, on the default model's attention shape (9 query
heads, 3 kv heads, head dim 64, pages of 16, float32), n = 1 and 16 rows all holding the same
context, microseconds per call (one layer; a step runs 30). Variants, interleaved round by
round (medians): XLA's loop with blocks of 64 positions (its default), 128, 256, 512
positions, and 64-position blocks unrolled U = 4 and 8 per loop iteration (identical
arithmetic, a U-fold smaller trip count; a copy here, not in the package), then the C++
kernel (`metrale_jax/kernels/decode_attention.py`, what a single CPU device runs), then the
same pool stored as an int8 KV cache (`models/kv_quant.py`) through XLA's 64-position loop and
through the kernel.

`engine`: the engine's decode step (the default model's shape, random weights, 16 slots,
max_len 1024), ms per step at 1 and 16 streams with 4- and 512-token prompts, with decode
attention as it is and replaced by `q -> q` (the step without it): the difference bounds
attention's share. Each measurement runs in a child process, the two interleaved.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
K, G, D, PS = 3, 3, 64, 16  # kv heads, query heads per kv head, head dim, page size


def unrolled_decode_attention(q, pages, page_table, kv_lens, *, sm_scale: float, unroll: int,
                              block_pages: int = 4):
    """`decode_attention` without window or soft cap, its loop running `unroll` blocks of
    `block_pages` pages per iteration (each block's update exactly as in the package)."""
    import jax
    import jax.numpy as jnp

    n, H, _ = q.shape
    bp, span = block_pages, block_pages * PS
    qg = q.reshape(n, K, G, D)
    table = jnp.pad(page_table, ((0, 0), (0, unroll * bp)))
    stop = (jnp.max(kv_lens) + unroll * span - 1) // (unroll * span)
    neg = jnp.finfo(jnp.float32).min

    def block(b, carry):
        m, denom, acc = carry
        idx = jax.lax.dynamic_slice_in_dim(table, b * bp, bp, axis=1)
        kv = pages[idx].reshape(n, span, K, 2, D)
        k, v = kv[..., 0, :], kv[..., 1, :]
        s = jnp.einsum("nkgd,nlkd->nkgl", qg, k, preferred_element_type=jnp.float32) * sm_scale
        kp = b * span + jnp.arange(span, dtype=jnp.int32)[None, :]
        valid = (kp < kv_lens[:, None])[:, None, None, :]
        m_new = jnp.maximum(m, jnp.max(jnp.where(valid, s, neg), axis=-1, keepdims=True))
        w = jnp.where(valid, jnp.exp(s - m_new), 0.0)
        scale = jnp.exp(m - m_new)
        out = jnp.einsum("nkgl,nlkd->nkgd", w, v, preferred_element_type=jnp.float32)
        return m_new, denom * scale + jnp.sum(w, axis=-1, keepdims=True), acc * scale + out

    def superblock(i, carry):
        for u in range(unroll):
            carry = block(i * unroll + u, carry)
        return carry

    init = (jnp.full((n, K, G, 1), neg, jnp.float32), jnp.zeros((n, K, G, 1), jnp.float32),
            jnp.zeros((n, K, G, D), jnp.float32))
    _, denom, acc = jax.lax.fori_loop(0, stop, superblock, init)
    return (acc / jnp.where(denom > 0, denom, 1.0)).reshape(n, H, D)


def micro(args) -> None:
    """Prints the micro-benchmark's table: µs per call of each variant."""
    # imported per case, after main puts this checkout on sys.path (the engine case's child
    # is a fresh process)
    import jax
    import jax.numpy as jnp
    import numpy as np

    from metrale_jax.models.kv_quant import quantize_rows
    from metrale_jax.models.paged_attention import decode_attention

    rows, max_len = 16, 1024
    pps = max_len // PS
    n_pages = 1 + rows * pps
    rng = np.random.default_rng(0)
    pages = jnp.asarray(rng.standard_normal((n_pages, PS, 2 * K, D)), jnp.float32)
    table = jnp.asarray(rng.permutation(np.arange(1, n_pages)).reshape(rows, pps), jnp.int32)
    q = jnp.asarray(rng.standard_normal((rows, K * G, D)), jnp.float32)
    opts = dict(sm_scale=D**-0.5)
    fns = {f"block {bp * PS}": jax.jit(functools.partial(
        decode_attention, sliding_window=None, soft_cap=None, block_pages=bp, kernel=False,
        **opts)) for bp in (4, 8, 16, 32)}
    for u in (4, 8):
        fns[f"64 x{u} unrolled"] = jax.jit(functools.partial(
            unrolled_decode_attention, unroll=u, **opts))
    fns["C++ kernel"] = jax.jit(functools.partial(
        decode_attention, sliding_window=None, soft_cap=None, **opts))
    # The same pool stored int8 (models/kv_quant.py): XLA's loop (dequantizing each block it
    # gathers) and the kernel's int8 target.
    int8_pages = quantize_rows(pages)
    fns["int8 KV, block 64"] = fns["block 64"]
    fns["int8 KV, C++ kernel"] = fns["C++ kernel"]
    pool = {name: int8_pages if name.startswith("int8") else pages for name in fns}
    names = list(fns)
    print("| rows | context | " + " | ".join(names) + " |")
    print("|---|---|" + "---|" * len(names))
    for n in (1, 16):
        for ctx in (16, 128, 512, 1024):
            lens = jnp.full((n,), ctx, jnp.int32)
            for name, f in fns.items():
                jax.block_until_ready(f(q[:n], pool[name], table[:n], lens))
            times: dict[str, list[float]] = {k: [] for k in fns}
            for _ in range(args.rounds):
                for name, f in fns.items():
                    a = (q[:n], pool[name], table[:n], lens)
                    t0 = time.perf_counter()
                    for _ in range(args.calls):
                        out = f(*a)
                    jax.block_until_ready(out)
                    times[name].append((time.perf_counter() - t0) / args.calls * 1e6)
            base = statistics.median(times[names[0]])
            cells = [f"{base:.0f} µs"] + [
                f"{statistics.median(times[k]):.0f} ({statistics.median(times[k]) / base:.2f}x)"
                for k in names[1:]]
            print(f"| {n} | {ctx} | " + " | ".join(cells) + " |", flush=True)


def engine_child(args) -> None:
    """One engine measurement (args.attention: "real" or "none"); prints one JSON line."""
    import jax
    import numpy as np
    from flax import nnx

    import metrale_jax.models.ragged as ragged
    from metrale_jax.config import ModelConfig
    from metrale_jax.engine import Engine, EngineConfig, SlotSettings
    from metrale_jax.models.transformer import Transformer

    if args.attention == "none":
        ragged.decode_attention = lambda q, *a, **kw: q
    shape = ModelConfig("llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                        num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64,
                        rope_theta=100000.0, tie_word_embeddings=True,
                        max_position_embeddings=8192)
    graphdef, params = nnx.split(Transformer(shape, rngs=nnx.Rngs(0)))
    slots = 16
    engine = Engine(shape, graphdef, params, EngineConfig(
        max_slots=slots, max_len=1024, max_prefill_len=512, compilation_cache_dir=None))
    out = {}
    for streams in (1, 16):
        for prompt in (4, 512):
            state = engine.init_decode_state()
            state, _ = engine.add(state, [(s, [1 + s] * prompt, SlotSettings())
                                          for s in range(streams)])
            mask = np.arange(slots) < streams
            for _ in range(2):
                state, res = engine.step(state, mask)
            jax.block_until_ready(res.tokens)
            t0 = time.perf_counter()
            for _ in range(args.steps):
                state, res = engine.step(state, mask)
            jax.block_until_ready(res.tokens)
            out[f"{streams}x{prompt}"] = (time.perf_counter() - t0) / args.steps * 1e3
    print(json.dumps(out))


def engine(args) -> None:
    """Prints the engine table: ms per decode step with and without decode attention."""
    got: dict[str, list[dict]] = {"real": [], "none": []}
    for _ in range(args.rounds):
        for mode in got:
            cmd = [sys.executable, __file__, "--child", "--attention", mode,
                   "--steps", str(args.steps)]
            res = subprocess.run(cmd, capture_output=True, text=True, cwd=HERE)
            if res.returncode:
                raise SystemExit(f"engine child ({mode}) failed:\n{res.stderr[-3000:]}")
            got[mode].append(json.loads(res.stdout.strip().splitlines()[-1]))
    print("| streams x prompt | step ms | step ms, no decode attention | attention's share |")
    print("|---|---|---|---|")
    for key in got["real"][0]:
        real = statistics.median(r[key] for r in got["real"])
        none = statistics.median(r[key] for r in got["none"])
        print(f"| {key.replace('x', ' x ')} | {real:.1f} | {none:.1f} | "
              f"{real - none:.1f} ms ({(real - none) / real:.0%}) |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="micro,engine")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=30, help="micro: calls per timing")
    ap.add_argument("--steps", type=int, default=16, help="engine: steps per timing")
    ap.add_argument("--child", action="store_true")
    ap.add_argument("--attention", default="real")
    args = ap.parse_args()
    sys.path.insert(0, str(HERE))
    if args.child:
        engine_child(args)
        return
    for case in args.cases.split(","):
        {"micro": micro, "engine": engine}[case](args)


if __name__ == "__main__":
    main()
