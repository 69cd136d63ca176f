"""A mixture-of-experts model against a dense model of the same active parameters.

    PYTHONPATH=$PWD python -m bench.moe [--streams 1,4,16] [--rounds 3] [--layers 4]

The MoE is Qwen3-30B-A3B's routing (128 experts, 8 active, expert width 3/8 of the hidden
size, 32/4 heads) at a quarter of its width and a few layers: E=512, F=192 per expert,
H=8, K=2, D=64, V=4096. The dense model has the same attention and one MLP of F = 8 * 192
(the active expert parameters). Both are random float32 models.

Table 1, decode tokens/s through the engine (unrolled layers, CPU) at each number of
streams, both engines built side by side and timed in alternation (`--rounds` rounds, the
median shown), and MoE / dense step time.
Table 2, the MLP alone (ms per call, best of 9, alternating): the routed MLP in each form of
its grouped product (`models/moe.py`: "tiles" is what the CPU runs, "ragged" is
`jax.lax.ragged_dot`, which XLA:CPU expands densely) against the dense MLP, per T tokens.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import jax

from bench.engine_common import decode_rate, random_model
from metrale_jax.config import ModelConfig
from metrale_jax.engine import Engine, EngineConfig
from metrale_jax.models.moe import expert_mix, route, tile_rows

MOE = ModelConfig("qwen3_moe", vocab_size=4096, hidden_size=512, intermediate_size=1536,
                  num_layers=4, num_heads=8, num_kv_heads=2, head_dim=64, qk_norm=True,
                  num_experts=128, experts_per_token=8, moe_intermediate_size=192,
                  norm_topk_prob=True)


def dense_of(moe: ModelConfig) -> ModelConfig:
    """The dense model of `moe`'s active parameters: one MLP of k * F_expert."""
    return dataclasses.replace(moe, architecture="qwen3", num_experts=0, experts_per_token=0,
                               moe_intermediate_size=0, norm_topk_prob=False,
                               intermediate_size=moe.experts_per_token
                               * moe.moe_intermediate_size)


def make_engine(cfg: ModelConfig, slots: int) -> Engine:
    graphdef, params = random_model(cfg)
    return Engine(cfg, graphdef, params, EngineConfig(
        max_slots=slots, max_len=256, max_prefill_len=64, max_prefill_batch=4,
        compilation_cache_dir=None, layer_loop="unrolled"))


def engine_table(streams: list[int], rounds: int, steps: int, layers: int) -> None:
    moe = dataclasses.replace(MOE, num_layers=layers)
    engines = {"moe": make_engine(moe, max(streams)),
               "dense": make_engine(dense_of(moe), max(streams))}
    print(f"decode tok/s, {layers} layers (median of {rounds} alternating rounds)")
    print(f"{'streams':>8} {'MoE':>9} {'dense':>9} {'MoE/dense time':>15}")
    for n in streams:
        rates: dict[str, list[float]] = {k: [] for k in engines}
        for _ in range(rounds):
            for name, engine in engines.items():
                rates[name].append(decode_rate(engine, n, steps))
        m, d = statistics.median(rates["moe"]), statistics.median(rates["dense"])
        print(f"{n:>8} {m:>9.1f} {d:>9.1f} {d / m:>14.2f}x")


def mlp_table(tokens: list[int]) -> None:
    cfg = MOE
    E, F, X, k = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, \
        cfg.experts_per_token
    key = iter(jax.random.split(jax.random.PRNGKey(0), 8))
    w = {name: (0.02 * jax.random.normal(next(key), shape), None)
         for name, shape in (("gate", (X, E, F)), ("up", (X, E, F)), ("down", (X, F, E)))}
    router = 0.02 * jax.random.normal(next(key), (E, X))
    dense = [0.02 * jax.random.normal(next(key), s) for s in ((E, k * F), (E, k * F),
                                                             (k * F, E))]

    def routed(form):
        def f(x):
            weights, experts = route(x @ router, k, True)
            return expert_mix(x, weights, experts, w, "silu", form)
        return jax.jit(f)

    @jax.jit
    def dense_mlp(x):
        return (jax.nn.silu(x @ dense[0]) * (x @ dense[1])) @ dense[2]

    print("\nthe MLP alone, ms per call (best of 9, alternating)")
    print(f"{'T':>5} {'tiles (m)':>12} {'ragged_dot':>11} {'dense':>8} {'tiles/dense':>12}")
    for T in tokens:
        x = jax.random.normal(next(iter(jax.random.split(jax.random.PRNGKey(T), 1))), (T, E))
        m = tile_rows(T * k, X)
        fns = {"tiles": routed(("tiles", m)), "ragged": routed(("ragged", 0)),
               "dense": dense_mlp}
        if T > 64:
            fns.pop("ragged")  # seconds per call on CPU
        best = {n: float("inf") for n in fns}
        for fn in fns.values():
            fn(x).block_until_ready()
        for _ in range(9):
            for name, fn in fns.items():
                t0 = time.perf_counter()
                fn(x).block_until_ready()
                best[name] = min(best[name], (time.perf_counter() - t0) * 1e3)
        ragged = f"{best['ragged']:.2f}" if "ragged" in best else "-"
        print(f"{T:>5} {best['tiles']:>8.2f} ({m:>2}) {ragged:>11} {best['dense']:>8.2f} "
              f"{best['tiles'] / best['dense']:>11.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--streams", default="1,4,16")
    parser.add_argument("--tokens", default="1,4,16,64,256")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()
    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}; MoE: X={MOE.num_experts} "
          f"k={MOE.experts_per_token} E={MOE.hidden_size} F={MOE.moe_intermediate_size}; "
          f"dense F={MOE.experts_per_token * MOE.moe_intermediate_size}")
    engine_table([int(s) for s in args.streams.split(",")], args.rounds, args.steps,
                 args.layers)
    mlp_table([int(t) for t in args.tokens.split(",")])


if __name__ == "__main__":
    main()
