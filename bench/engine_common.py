"""What `bench/engine.py` and its mesh table (`bench/engine_mesh.py`) share: the benchmark's
model shape, its random-weight model, the engine config from the flags, and the decode timing
loop. Below both, so neither imports the other for them; imports only metrale_jax.
"""

from __future__ import annotations

import time

import jax
import numpy as np
from flax import nnx

from metrale_jax.config import ModelConfig
from metrale_jax.engine import Engine, EngineConfig, SlotSettings
from metrale_jax.models.transformer import Transformer

DEFAULT_SHAPE = ModelConfig("llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                            num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64,
                            rope_theta=100000.0, tie_word_embeddings=True,
                            max_position_embeddings=8192)


def random_model(cfg: ModelConfig = DEFAULT_SHAPE):
    """`(graphdef, params)` of a `Transformer` of shape `cfg` with random weights."""
    return nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))


def engine_config(args, slots: int, cache_dir: str | None) -> EngineConfig:
    """The engine config of the benchmark's flags, with `slots` slots."""
    return EngineConfig(max_slots=slots, max_len=args.max_len, max_prefill_len=args.max_prefill,
                        max_prefill_batch=min(args.prefill_batch, slots),
                        decode_steps=args.decode_steps, compilation_cache_dir=cache_dir)


def timed_steps(engine: Engine, state, mask: np.ndarray, steps: int) -> tuple[object, float]:
    """Two warm-up steps of the rows in `mask` [B] bool, then `steps` timed ones: (the
    state after them, the seconds the timed steps took)."""
    for _ in range(2):
        state, out = engine.step(state, mask)
    jax.block_until_ready(out.tokens)
    t0 = time.perf_counter()
    for _ in range(steps):
        state, out = engine.step(state, mask)
    jax.block_until_ready(out.tokens)
    return state, time.perf_counter() - t0


def decode_rate(engine: Engine, active: int, steps: int) -> float:
    """Aggregate decode tokens/s with `active` slots busy."""
    state = engine.init_decode_state()
    items = [(s, [1] * 16, SlotSettings()) for s in range(active)]
    state, _ = engine.add(state, items)
    _, dt = timed_steps(engine, state, np.arange(engine.config.max_slots) < active, steps)
    return active * steps * engine.config.decode_steps / dt
