"""The scanned layer loop on a mesh (4 fake CPU devices, data=2, model=2): its stacked page pool
`[L, N, ps, 2K, D]` shards the kv heads over "model" and the engine gives the single-device
unrolled engine's greedy tokens.

One subprocess (XLA_FLAGS set before jax is imported) runs this file as a script and prints a
JSON report of tokens and shardings, which the test checks.
"""

from __future__ import annotations

import json
import sys

from tests.fake_devices import print_report, run_child

SHAPES = dict(max_slots=4, max_len=64, min_prefill_bucket=16, max_prefill_len=16,
              max_prefill_batch=2, num_top_logprobs=3)
MODEL = dict(architecture="qwen3", vocab_size=512, hidden_size=64, intermediate_size=128,
             num_layers=4, head_dim=16, num_heads=4, num_kv_heads=2, qk_norm=True)
STEPS = 5


def _run(cfg, graphdef, params, loop: str, mesh, cache_dir: str) -> dict:
    import numpy as np

    from metrale_jax.engine import Engine, EngineConfig, SlotSettings

    engine = Engine(cfg, graphdef, params, EngineConfig(
        **SHAPES, mesh=mesh, layer_loop=loop, compilation_cache_dir=cache_dir))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (5, 23)]
    state = engine.init_decode_state()
    state, first = engine.add(state, [(s, p, SlotSettings()) for s, p in enumerate(prompts)])
    tokens = [np.asarray(first.tokens)[0, :2].tolist()]
    active = np.arange(engine.config.max_slots) < 2
    for _ in range(STEPS):
        state, out = engine.step(state, active)
        tokens.append(np.asarray(out.tokens)[0, :2].tolist())
    pages = state.pages
    pool = pages if not isinstance(pages, tuple) else pages[0]
    return dict(tokens=tokens, pool_shape=list(pool.shape),
                pool_spec=[str(x) for x in pool.sharding.spec])


def child_main(cache_dir: str) -> None:
    import jax
    from flax import nnx

    from metrale_jax.config import ModelConfig
    from metrale_jax.models.transformer import Transformer

    cfg = ModelConfig(**MODEL)
    graphdef, params = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))
    params = jax.tree.map(lambda x: x * 10.0 if x.ndim > 1 else x, params)
    print_report({"single": _run(cfg, graphdef, params, "unrolled", (1, 1), cache_dir),
                  "mesh": _run(cfg, graphdef, params, "scan", (2, 2), cache_dir)})


def test_scanned_engine_on_a_mesh_gives_the_single_device_tokens():
    from tests.conftest import CACHE
    report = run_child(__file__, json.dumps(str(CACHE)), timeout=600, devices=4)
    single, mesh = report["single"], report["mesh"]
    assert mesh["tokens"] == single["tokens"]
    assert mesh["pool_shape"][0] == MODEL["num_layers"]  # one stacked pool
    assert mesh["pool_spec"][3] == "model"  # the 2K kv rows over "model"
    assert "data" not in mesh["pool_spec"]


if __name__ == "__main__":
    child_main(json.loads(sys.argv[1]))
