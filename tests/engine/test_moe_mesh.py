"""A mixture-of-experts model on the 8-device CPU mesh, experts sharded over "model": the
engine (unrolled on data=2 x model=4, scanned on model=8) gives the single device's greedy
tokens and logprobs.

One subprocess (XLA_FLAGS set before jax is imported) runs this file as a script and prints a
JSON report, which the test checks.
"""

from __future__ import annotations

import json
import sys

from tests.fake_devices import print_report, run_child

SHAPES = dict(max_slots=4, max_len=64, min_prefill_bucket=16, max_prefill_len=16,
              max_prefill_batch=2, num_top_logprobs=3)
MODEL = dict(architecture="qwen3_moe", vocab_size=512, hidden_size=64, intermediate_size=128,
             num_layers=2, head_dim=16, num_heads=4, num_kv_heads=2, qk_norm=True,
             num_experts=8, experts_per_token=2, moe_intermediate_size=32, norm_topk_prob=True)
STEPS = 6


def _run(cfg, graphdef, params, loop: str, mesh, cache_dir: str) -> dict:
    import numpy as np

    from metrale_jax.engine import Engine, EngineConfig, SlotSettings

    engine = Engine(cfg, graphdef, params, EngineConfig(
        **SHAPES, mesh=mesh, layer_loop=loop, compilation_cache_dir=cache_dir))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (5, 23, 11)]
    state = engine.init_decode_state()
    state, first = engine.add(state, [(s, p, SlotSettings()) for s, p in enumerate(prompts)])
    tokens = [np.asarray(first.tokens)[0, :3].tolist()]
    logprobs = [np.asarray(first.logprobs)[0, :3].tolist()]
    active = np.arange(engine.config.max_slots) < 3
    for _ in range(STEPS):
        state, out = engine.step(state, active)
        tokens.append(np.asarray(out.tokens)[0, :3].tolist())
        logprobs.append(np.asarray(out.logprobs)[0, :3].tolist())
    blocks = engine.params.blocks if loop == "scan" else engine.params.layers[0]
    return dict(tokens=tokens, logprobs=logprobs,
                gate_spec=[str(x) for x in blocks["moe"]["gate"][...].sharding.spec])


def child_main(cache_dir: str) -> None:
    import jax
    from flax import nnx

    from metrale_jax.config import ModelConfig
    from metrale_jax.models.transformer import Transformer

    cfg = ModelConfig(**MODEL)
    graphdef, params = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))
    params = jax.tree.map(lambda x: x * 10.0 if x.ndim > 1 else x, params)
    print_report({"single": _run(cfg, graphdef, params, "unrolled", (1, 1), cache_dir),
                  "mesh": _run(cfg, graphdef, params, "unrolled", (2, 4), cache_dir),
                  "scan": _run(cfg, graphdef, params, "scan", (1, 8), cache_dir)})


def test_moe_with_experts_sharded_gives_the_single_device_tokens():
    import numpy as np

    from tests.conftest import CACHE
    report = run_child(__file__, json.dumps(str(CACHE)), timeout=900, devices=8)
    single = report["single"]
    for key, experts_axis in (("mesh", 0), ("scan", 1)):  # scan: [L, X, E, F]
        got = report[key]
        assert got["tokens"] == single["tokens"], key
        np.testing.assert_allclose(got["logprobs"], single["logprobs"], rtol=1e-4, atol=1e-4)
        assert got["gate_spec"][experts_axis] == "model", (key, got["gate_spec"])


if __name__ == "__main__":
    child_main(json.loads(sys.argv[1]))
