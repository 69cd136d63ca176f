"""`bench/engine.py --mesh`: the engine's throughput on several meshes, as an overhead table.

Each mesh runs in its own child process whose XLA_FLAGS give it enough fake CPU devices
(`--xla_force_host_platform_device_count`, set before jax is imported), or the real devices
with `--real-devices` (a GPU or TPU host). On fake devices every "device" shares the same
cores, so sharding buys nothing there: the table shows what the collectives and partitioned
programs cost (the overhead), not a speedup.

    .venv/bin/python bench/engine.py --mesh data=1,model=1 data=1,model=2 data=2,model=1
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

DEFAULT_MESHES = ("data=1,model=1", "data=1,model=2", "data=2,model=1")


def child(args, mesh: str) -> dict:
    """In the child: one engine on `mesh`; decode tokens/s with every slot busy, prefill
    tokens/s of one full bucket, time to first token."""
    # in the child, after its XLA_FLAGS set the fake device count
    import jax
    import numpy as np

    from bench.engine_common import DEFAULT_SHAPE, decode_rate, engine_config, random_model
    from metrale_jax.engine import Engine, SlotSettings

    graphdef, params = random_model()
    cfg = dataclasses.replace(engine_config(args, args.slots, args.cache_dir), mesh=mesh)
    engine = Engine(DEFAULT_SHAPE, graphdef, params, cfg)
    B, P = engine.config.max_slots, engine.config.max_prefill_len

    def add(state, n: int, length: int):
        items = [(s, [1 + s] * length, SlotSettings()) for s in range(n)]
        return engine.add(state, items)

    state, first = add(engine.init_decode_state(), 1, P)  # compiles
    np.asarray(first.tokens)
    times = []
    for _ in range(3):
        state = engine.init_decode_state()
        jax.block_until_ready(state.positions)
        t0 = time.perf_counter()
        state, first = add(state, 1, P)
        np.asarray(first.tokens)
        times.append(time.perf_counter() - t0)
    prefill_s = float(np.median(times))
    decode_tok_s = decode_rate(engine, B, args.steps)
    step_s = B * engine.config.decode_steps / decode_tok_s
    return {"mesh": mesh, "devices": len(first.tokens.sharding.device_set),
            "platform": jax.devices()[0].platform, "decode_tok_s": decode_tok_s,
            "step_ms": step_s * 1000, "prefill_tok_s": P / prefill_s,
            "prefill_ms": prefill_s * 1000, "slots": B, "bucket": P}


def table(args) -> None:
    """Runs every mesh of `args.mesh` in a child and prints the overhead table."""
    from metrale_jax.engine.sharding import parse_mesh  # the parent imports no JAX
    rows = []
    for mesh in args.mesh:
        data, model = parse_mesh(mesh)
        env = dict(os.environ)
        if not args.real_devices:
            env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_"
                                f"device_count={max(1, data * model)}").strip()
            env["JAX_PLATFORMS"] = "cpu"
        cmd = [sys.executable, str(Path(__file__).with_name("engine.py")), "--mesh-child", mesh,
               "--slots", str(args.slots), "--max-len", str(args.max_len),
               "--max-prefill", str(args.max_prefill), "--prefill-batch", str(args.prefill_batch),
               "--decode-steps", str(args.decode_steps), "--steps", str(args.steps)]
        if args.cache_dir:
            cmd += ["--cache-dir", args.cache_dir]
        res = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if res.returncode != 0:
            raise SystemExit(f"mesh {mesh} failed:\n{res.stderr[-3000:]}")
        rows.append(json.loads(res.stdout.strip().splitlines()[-1]))
    base = rows[0]
    kind = "real devices" if args.real_devices else "fake CPU devices sharing the cores"
    print(f"Metrale-JAX engine on meshes ({rows[0]['platform']}, {kind}), default-model shape, "
          f"{base['slots']} slots busy, S={args.max_len}, prefill bucket {base['bucket']}")
    head = ("mesh", "devices", "decode tok/s", "step ms", "vs first", "prefill tok/s",
            "vs first")
    print("  " + "  ".join(f"{h:>14}" for h in head))
    for r in rows:
        cells = (r["mesh"], r["devices"], f"{r['decode_tok_s']:,.1f}", f"{r['step_ms']:.1f}",
                 f"{r['decode_tok_s'] / base['decode_tok_s']:.2f}x",
                 f"{r['prefill_tok_s']:,.0f}",
                 f"{r['prefill_tok_s'] / base['prefill_tok_s']:.2f}x")
        print("  " + "  ".join(f"{c!s:>14}" for c in cells))
    assert all(math.isfinite(r["decode_tok_s"]) for r in rows)
