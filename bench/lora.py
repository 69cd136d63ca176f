"""Decode speed with LoRA adapters: none, one for every stream, four different across the batch.

The default model's shape with random weights (`bench/engine_common.py`), 16 streams decoding
after 16-token prompts, rank-16 random adapters on every projection (q, k, v, o, gate, up,
down). Two engines: one built without adapter slots (today's programs: no LoRA products at
all) and one with `max_loras=4, max_lora_rank=16`, the latter timed with every row on no
adapter, on one adapter, and on four adapters (rows round-robin). Rounds alternate the cases
(this machine's noise hits them alike); medians are printed with the step time relative to
the engine without slots.

    .venv/bin/python bench/lora.py                 # 16 streams, 3 rounds
    .venv/bin/python bench/lora.py --streams 8 --rounds 5
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np

from bench.engine_common import DEFAULT_SHAPE, random_model, timed_steps
from metrale_jax.engine import Engine, EngineConfig, SlotSettings
from metrale_jax.models.lora import MODULES, module_shape
from metrale_jax.weights.lora import LoraAdapter


def random_adapter(seed: int, rank: int) -> LoraAdapter:
    """A rank-`rank` adapter on every projection of DEFAULT_SHAPE, small random weights."""
    rng = np.random.default_rng(seed)
    L = DEFAULT_SHAPE.num_layers
    weights = {}
    for m in MODULES:
        fan_in, fan_out = module_shape(DEFAULT_SHAPE, m)
        weights[m] = (0.02 * rng.standard_normal((L, fan_in, rank), np.float32),
                      0.02 * rng.standard_normal((L, rank, fan_out), np.float32))
    return LoraAdapter(f"random{seed}", "", rank, 2.0, weights)


def rate(engine: Engine, streams: int, steps: int, rows: np.ndarray | None) -> float:
    """Decode tokens/s of `streams` rows; `rows`: each row's adapter slot (None: no slots)."""
    state = engine.init_decode_state()
    state, _ = engine.add(state, [(s, [1] * 16, SlotSettings()) for s in range(streams)])
    if rows is not None:  # each row's weight 1 on its slot (-1: none)
        engine.lora_slots.mix[:] = 0
        for b, slot in enumerate(rows):
            if slot >= 0:
                engine.lora_slots.mix[b, slot] = 1.0
    _, seconds = timed_steps(engine, state, np.arange(engine.config.max_slots) < streams,
                             steps)
    return streams * steps / seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rank", type=int, default=16)
    args = ap.parse_args()
    graphdef, params = random_model()
    common = dict(max_slots=args.streams, max_len=256, max_prefill_len=64,
                  compilation_cache_dir=None)
    plain = Engine(DEFAULT_SHAPE, graphdef, params, EngineConfig(**common))
    lora = Engine(DEFAULT_SHAPE, graphdef, params,
                  EngineConfig(**common, max_loras=4, max_lora_rank=args.rank))
    for slot in range(4):
        lora.set_lora(slot, random_adapter(slot, args.rank))
    s = args.streams
    cases = {"no slots (today's programs)": (plain, None),
             "slots, no adapter on any row": (lora, np.full(s, -1, np.int32)),
             "one adapter on every row": (lora, np.zeros(s, np.int32)),
             "four adapters across the rows": (lora, np.arange(s, dtype=np.int32) % 4)}
    for engine, rows in cases.values():  # compile and warm
        rate(engine, s, 2, rows)
    got: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(args.rounds):
        for name, (engine, rows) in cases.items():
            got[name].append(rate(engine, s, args.steps, rows))
    base = statistics.median(got["no slots (today's programs)"])
    print(f"\n{s} streams decoding, rank-{args.rank} adapters on every projection, default "
          f"model shape (random weights), median of {args.rounds} rounds\n")
    print("| case | tok/s | step time / no slots |\n|---|---|---|")
    for name, values in got.items():
        med = statistics.median(values)
        print(f"| {name} | {med:.1f} | {base / med:.2f}x |")


if __name__ == "__main__":
    main()
