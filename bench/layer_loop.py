"""The layer loop's two forms side by side (`EngineConfig.layer_loop`, `models/scanned.py`):
compile time against depth, and decode speed.

    PYTHONPATH=$PWD python -m bench.layer_loop [--depths 15,30,60] [--quantization none,int4]

Table 1, compile seconds of one program on random models of the benchmark shape
(`bench/engine_common.DEFAULT_SHAPE`) with `num_layers` changed, the persistent compilation
cache off (after a warm-up compile of a 2-layer model's step, which the process's first
compile pays for): the engine's decode-only step of 16 rows, its step with a 512-token chunk,
and the layers alone (embedding, layers, head over 16 decode rows: the step without its
sampler). Each depth compiles unrolled then scanned.
Table 2, decode tokens/s at 1 and 16 streams on the 30-layer shape, both forms' engines built
side by side and timed in alternation (`--rounds` rounds, the median shown).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import statistics
import time

import jax
import jax.numpy as jnp

from bench.engine_common import DEFAULT_SHAPE, decode_rate, random_model
from metrale_jax.engine import Engine, EngineConfig
from metrale_jax.models.ragged import StepLayout, head, ragged_layers

FORMS = ("unrolled", "scan")


def make_engine(cfg, graphdef, params, loop: str, *, slots: int, max_len: int,
                quantization: str | None = None) -> Engine:
    """An engine of `slots` slots and `max_len` positions (512-token chunks), layer loop
    `loop`, no persistent compilation cache."""
    config = EngineConfig(max_slots=slots, max_len=max_len, max_prefill_len=512,
                          max_prefill_batch=4, compilation_cache_dir=None, layer_loop=loop,
                          quantization=quantization)
    return Engine(cfg, graphdef, params, config)


def seconds(fn) -> float:
    """Wall seconds of `fn()`."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def layers_only_compile(engine: Engine, n: int = 16) -> float:
    """Seconds to compile the embedding, the layers and the head over n decode rows (one
    token each), without the sampler."""
    cfg = engine.config
    pps = cfg.pages_per_seq
    i32 = jnp.int32

    def forward(params, pages, tokens, positions, layout):
        x, pages = ragged_layers(engine.graph, params, pages, tokens, positions, layout, n=n)
        return head(engine.graph, params, x), pages

    def sds(shape, dtype=i32):
        return jax.ShapeDtypeStruct(shape, dtype)

    layout = StepLayout(slots=sds((n,)), dec_table=sds((n, pps)), dec_lens=sds((n,)),
                        chunk_rows=sds((0,)), page_table=sds((cfg.max_slots, pps)))
    params = jax.tree.map(lambda a: sds(a.shape, a.dtype), engine.params)
    pages = jax.tree.map(lambda a: sds(a.shape, a.dtype), engine.step_programs.state_spec.pages)
    return seconds(lambda: jax.jit(forward, donate_argnums=(1,)).lower(
        params, pages, sds((n,)), sds((n,)), layout).compile())


def compile_table(depths: list[int]) -> None:
    """Table 1 (see the module docstring)."""
    cfg = dataclasses.replace(DEFAULT_SHAPE, num_layers=2)  # the process's first compiles
    graphdef, params = random_model(cfg)
    for loop in FORMS:
        make_engine(cfg, graphdef, params, loop, slots=16, max_len=1024).step_programs.step(
            16, 0, 1)
    print("| layers | form | decode step, 16 rows (s) | 512-token chunk step (s) | "
          "layers only, 16 rows (s) |")
    print("|---|---|---|---|---|")
    for depth in depths:
        cfg = dataclasses.replace(DEFAULT_SHAPE, num_layers=depth)
        graphdef, params = random_model(cfg)
        for loop in FORMS:
            engine = make_engine(cfg, graphdef, params, loop, slots=16, max_len=1024)
            step = engine.step_programs.step
            mixed = max(engine.config.mixed_row_buckets)
            decode = seconds(functools.partial(step, 16, 0, 1))
            chunk = seconds(functools.partial(step, mixed, 512, 1))
            alone = layers_only_compile(engine)
            print(f"| {depth} | {loop} | {decode:.2f} | {chunk:.2f} | {alone:.2f} |",
                  flush=True)
            del engine, step
            gc.collect()
        del params
        gc.collect()


def decode_table(quantizations: list[str | None], rounds: int, steps: int) -> None:
    """Table 2 (see the module docstring)."""
    print("| weights | streams | unrolled tok/s | scan tok/s | scan / unrolled |")
    print("|---|---|---|---|---|")
    graphdef, params = random_model(DEFAULT_SHAPE)
    for quant in quantizations:
        engines = {loop: make_engine(DEFAULT_SHAPE, graphdef, params, loop, slots=16,
                                     max_len=512, quantization=quant) for loop in FORMS}
        for engine in engines.values():  # compile both decode programs first
            for active in (1, 16):
                decode_rate(engine, active, 1)
        rates: dict[tuple[str, int], list[float]] = {}
        for _ in range(rounds):
            for active in (1, 16):
                for loop, engine in engines.items():
                    rates.setdefault((loop, active), []).append(
                        decode_rate(engine, active, steps))
        for active in (1, 16):
            u = statistics.median(rates["unrolled", active])
            s = statistics.median(rates["scan", active])
            print(f"| {quant or 'float32'} | {active} | {u:.1f} | {s:.1f} | {s / u:.3f} |",
                  flush=True)
        del engines
        gc.collect()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--depths", default="15,30,60")
    p.add_argument("--quantization", default="none,int4",
                   help="weights of the decode table: none (float32), int8, int8-all, int4")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=16, help="timed decode steps per figure")
    p.add_argument("--no-compile", action="store_true", help="only the decode table")
    p.add_argument("--no-decode", action="store_true", help="only the compile table")
    args = p.parse_args()
    print(f"backend {jax.default_backend()}, {jax.device_count()} device(s)")
    if not args.no_compile:
        compile_table([int(d) for d in args.depths.split(",")])
    if not args.no_decode:
        quants = [None if q == "none" else q for q in args.quantization.split(",")]
        decode_table(quants, args.rounds, args.steps)


if __name__ == "__main__":
    main()
