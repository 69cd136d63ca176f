"""The paged engine beside the engine of an older commit, side by side in one run.

Both engines run the same measurements on the default model's shape (random weights), each
measurement in a child process importing `metrale_jax` from its checkout, the two engines
interleaved round by round (medians over rounds): this machine's noise hits both alike.

    git worktree add /tmp/old-engine fdb1871      # the contiguous-cache engine
    .venv/bin/python bench/paged.py --old /tmp/old-engine
    .venv/bin/python bench/paged.py --old /tmp/old-engine --rounds 1 --cases decode

Cases: `decode` (aggregate tokens/s at 1 and 16 streams, 16-token prompts, and 16 streams
holding 512 tokens each), `prefill` (time to first token of one 512 / 2,048 / 8,000-token
prompt with max_len 8192), `warmup` (programs and seconds, empty cache then warm), `capacity`
(sequences of 256 tokens that fit 1 GiB of KV cache). Prints one table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]


def _child(args) -> None:
    """Runs one measurement with the checkout at args.root; prints one JSON line."""
    sys.path.insert(0, args.root)  # the checkout under test: imported only after this
    import jax
    import numpy as np
    from flax import nnx

    from metrale_jax.config import ModelConfig
    from metrale_jax.engine import Engine, EngineConfig, SlotSettings
    from metrale_jax.models.transformer import Transformer

    shape = ModelConfig("llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                        num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64,
                        rope_theta=100000.0, tie_word_embeddings=True,
                        max_position_embeddings=8192)
    if args.case == "capacity":
        from metrale_jax.engine.placement import place  # from args.root, as above
        p = place(shape, EngineConfig(max_slots=None, max_len=4096, memory_gb=args.memory_gb,
                                      compilation_cache_dir=None), n_devices=1)
        pages = getattr(p.config, "num_pages", None)
        plan = p.plan
        kv_gib = (plan.memory_bytes - plan.param_bytes - plan.scratch_bytes
                  - plan.reserve_bytes) / 2**30
        # Old: each slot reserves max_len whatever it holds; new: 256 tokens' pages.
        seqs = (pages - 1) // (256 // p.config.page_size) if pages else p.config.max_slots
        print(json.dumps({"sequences": seqs, "kv_gib": kv_gib}))
        return
    graphdef, params = nnx.split(Transformer(shape, rngs=nnx.Rngs(0)))
    slots = 16 if args.case == "decode" else 4
    max_len = 1024 if args.case == "decode" else 8192
    cfg = EngineConfig(max_slots=slots, max_len=max_len, max_prefill_len=512,
                       compilation_cache_dir=args.cache_dir)
    engine = Engine(shape, graphdef, params, cfg)
    if args.case == "warmup":
        t0 = time.perf_counter()
        engine.warmup()
        print(json.dumps({"seconds": time.perf_counter() - t0,
                          "programs": engine.compile_count}))
        return
    out: dict[str, float] = {}
    if args.case == "decode":
        for streams, prompt in ((1, 16), (16, 16), (16, 512)):
            state = engine.init_decode_state()
            items = [(s, [1 + s] * prompt, SlotSettings()) for s in range(streams)]
            state, _ = engine.add(state, items)
            mask = np.arange(slots) < streams
            for _ in range(2):
                state, res = engine.step(state, mask)
            jax.block_until_ready(res.tokens)
            t0 = time.perf_counter()
            for _ in range(args.steps):
                state, res = engine.step(state, mask)
            jax.block_until_ready(res.tokens)
            out[f"{streams}x{prompt}"] = streams * args.steps / (time.perf_counter() - t0)
    else:  # prefill
        rng = np.random.default_rng(0)
        for n in (512, 2048, 8000):
            ids = rng.integers(0, 49152, n).tolist()
            state = engine.init_decode_state()
            state, first = engine.add(state, [(0, ids, SlotSettings())])  # compiles, warms
            jax.block_until_ready(first.tokens)
            state = engine.init_decode_state()
            t0 = time.perf_counter()
            state, first = engine.add(state, [(0, ids, SlotSettings())])
            np.asarray(first.tokens)
            out[str(n)] = time.perf_counter() - t0
    print(json.dumps(out))


def _run(root: str, case: str, args, cache_dir: str) -> dict:
    cmd = [sys.executable, __file__, "--child", "--root", root, "--case", case,
           "--cache-dir", cache_dir, "--steps", str(args.steps),
           "--memory-gb", str(args.memory_gb)]
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=root)
    if res.returncode:
        raise SystemExit(f"{case} in {root} failed:\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", required=False, help="checkout of the older engine (a worktree)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--memory-gb", type=float, default=1.5)
    ap.add_argument("--cases", default="decode,prefill,warmup,capacity")
    ap.add_argument("--child", action="store_true")
    ap.add_argument("--root", default=str(HERE))
    ap.add_argument("--case", default="decode")
    ap.add_argument("--cache-dir", default=None)
    args = ap.parse_args()
    if args.child:
        _child(args)
        return
    roots = {"old": args.old, "new": str(HERE)}
    rows: list[tuple[str, str, str, str]] = []
    with tempfile.TemporaryDirectory() as tmp:
        caches = {name: f"{tmp}/{name}" for name in roots}
        for case in args.cases.split(","):
            if case == "warmup":
                got = {name: [_run(root, case, args, f"{tmp}/{name}-w")
                              for _ in range(2)] for name, root in roots.items()}
                cells = {name: f"{c['programs']} / {c['seconds']:.1f} / {w['seconds']:.1f}"
                         for name, (c, w) in got.items()}
                rows.append(("warmup: programs / cold s / warm s", cells["old"], cells["new"],
                             ""))
                continue
            rounds = 1 if case == "capacity" else args.rounds
            results: dict[str, list[dict]] = {name: [] for name in roots}
            for _ in range(rounds):
                for name, root in roots.items():
                    results[name].append(_run(root, case, args, caches[name]))
            keys = results["new"][0].keys()
            for key in keys:
                med = {name: statistics.median(r[key] for r in results[name])
                       for name in roots}
                unit = {"decode": "tok/s", "prefill": "s to first token",
                        "capacity": ""}[case]
                label = {"decode": f"decode {key.replace('x', ' streams x ')}-token prompts",
                         "prefill": f"prefill {key} tokens",
                         "capacity": f"{key} ({args.memory_gb} GiB, 256-token requests)"}[case]
                extra = ""
                if case == "prefill":
                    extra = " / ".join(f"{name} {int(key) / med[name]:.0f} tok/s"
                                       for name in roots)
                rows.append((f"{label} {unit}", f"{med['old']:.2f}", f"{med['new']:.2f}",
                             f"{med['new'] / med['old']:.2f}x {extra}"))
    print(f"| measure | old ({args.old}) | new | new/old |")
    print("|---|---|---|---|")
    for r in rows:
        print("| " + " | ".join(r) + " |")


if __name__ == "__main__":
    main()
