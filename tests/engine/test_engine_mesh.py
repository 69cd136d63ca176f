"""The `Engine` on 8 fake CPU devices gives the single-device greedy tokens on every mesh.

One subprocess (XLA_FLAGS=--xla_force_host_platform_device_count=8, set before jax is
imported) runs this file as a script: per tiny model, an engine on one device and one per
mesh of its `MODEL_MESHES` each take the same three prompts (two short ones prefilled as one
batch, one longer than the largest bucket, chunked) with greedy settings (one slot with
penalties on), then decode; the child prints a JSON report of tokens and of where the arrays
live, which the tests below check. Each of the four 8-device meshes runs once (every engine
compiles its own programs, so all eight pairs cost twice the time and cover no more): the
llama model, whose 8 kv heads divide every model axis, on (2, 4) and (8, 1); the qwen3 model,
2 kv heads, on (4, 2) (kv heads sharded) and (1, 8) (replicated).
"""

from __future__ import annotations

import json
import sys

import pytest

from tests.fake_devices import print_report, run_child

MESHES = [(1, 8), (2, 4), (4, 2), (8, 1)]
MODEL_MESHES = {"llama-h8-k8": [(2, 4), (8, 1)], "qwen3-h8-k2": [(4, 2), (1, 8)]}
SHAPES = dict(max_slots=8, max_len=64, min_prefill_bucket=16, max_prefill_len=16,
              max_prefill_batch=2, num_top_logprobs=3)
STEPS = 6
TINY_BASE = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2,
                 head_dim=16)
MODELS = {
    "llama-h8-k8": dict(architecture="llama", num_heads=8, num_kv_heads=8),
    # kv heads shard on model=2, replicate on model=4 and 8
    "qwen3-h8-k2": dict(architecture="qwen3", num_heads=8, num_kv_heads=2, qk_norm=True,
                        attention_bias=True, tie_word_embeddings=True),
}


# ---- the child -----------------------------------------------------------------------------
def _run(cfg, graphdef, params, mesh, cache_dir: str) -> dict:
    import jax
    import numpy as np

    from metrale_jax.engine import Engine, EngineConfig, SlotSettings

    engine = Engine(cfg, graphdef, params, EngineConfig(**SHAPES, mesh=mesh,
                                                        compilation_cache_dir=cache_dir))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (5, 12, 23)]
    settings = [SlotSettings(), SlotSettings(repetition_penalty=1.3, presence_penalty=0.5),
                SlotSettings()]
    state = engine.init_decode_state()
    state, first = engine.add(state, [(s, p, x) for s, (p, x) in
                                      enumerate(zip(prompts, settings, strict=True))])
    tokens = [np.asarray(first.tokens)[0, :3].tolist()]
    active = np.arange(engine.config.max_slots) < 3
    compiles = engine.compile_count
    outs = []
    for _ in range(STEPS):
        state, out = engine.step(state, active)
        outs.append(out)
    tokens += [np.asarray(o.tokens)[0, :3].tolist() for o in outs]
    q = engine.params.layers[0]["attn"]["q_proj"][...]
    return dict(
        mesh=list(engine.mesh.shape.values()), tokens=tokens,
        devices=len(state.pages[0].sharding.device_set),
        q_proj_spec=[str(x) for x in q.sharding.spec],
        cache_spec=[str(x) for x in state.pages[0].sharding.spec],
        positions_spec=[str(x) for x in state.positions.sharding.spec],
        counts_spec=[str(x) for x in state.history.counts.sharding.spec],
        out_replicated=bool(outs[-1].tokens.sharding.is_fully_replicated),
        buckets=list(engine.config.active_slot_buckets),
        step_compiles=engine.compile_count - compiles, total_compiles=engine.compile_count,
        plan_slots=engine.memory_plan.slots, jax_devices=len(jax.devices()))


def child_main(spec: dict) -> None:
    """Runs every model on one device and on every mesh; prints one JSON report."""
    import jax
    from flax import nnx

    from metrale_jax.config import ModelConfig
    from metrale_jax.models.transformer import Transformer

    assert len(jax.devices()) == 8, jax.devices()
    reports = []
    for name, fields in MODELS.items():
        cfg = ModelConfig(**{**TINY_BASE, **fields})
        graphdef, params = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))
        params = jax.tree.map(lambda x: x * 3.0 if x.ndim > 1 else x, params)
        for mesh in [(1, 1), *MODEL_MESHES[name]]:
            reports.append(dict(model=name, **_run(cfg, graphdef, params, mesh,
                                                   spec["cache_dir"])))
            jax.clear_caches()
    print_report(reports)


# ---- the tests -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def reports() -> list[dict]:
    from tests.conftest import CACHE
    return run_child(__file__, json.dumps({"cache_dir": str(CACHE)}), timeout=1500)


def _by(reports, model, mesh):
    (r,) = [r for r in reports if r["model"] == model and tuple(r["mesh"]) == mesh]
    return r


def test_every_mesh_ran_on_its_devices(reports):
    assert sorted(m for ms in MODEL_MESHES.values() for m in ms) == sorted(MESHES)
    for name in MODELS:
        assert _by(reports, name, (1, 1))["devices"] == 1
        for mesh in MODEL_MESHES[name]:
            assert _by(reports, name, mesh)["devices"] == 8


def test_greedy_tokens_identical_to_one_device(reports):
    bad = []
    for name in MODELS:
        ref = _by(reports, name, (1, 1))["tokens"]
        assert len(ref) == STEPS + 1
        bad += [(name, m, _by(reports, name, m)["tokens"], ref) for m in MODEL_MESHES[name]
                if _by(reports, name, m)["tokens"] != ref]
    assert not bad


def test_arrays_sharded_by_the_rules(reports):
    r = _by(reports, "llama-h8-k8", (2, 4))
    assert r["q_proj_spec"] == ["None", "model", "None"]  # [E, H, D]: heads on model
    # page pool [N, ps, 2K, D]: key/value head pairs on model; pages shared by every row,
    # so not on data
    assert r["cache_spec"] == ["None", "None", "model", "None"]
    assert r["positions_spec"] == ["data"] and r["counts_spec"] == ["data", "None"]
    # 2 kv heads on model=8: replicated; sharded on model=2
    assert _by(reports, "qwen3-h8-k2", (1, 8))["cache_spec"] == ["None", "None", "None",
                                                                 "None"]
    assert _by(reports, "qwen3-h8-k2", (4, 2))["cache_spec"] == ["None", "None", "model",
                                                                 "None"]
    assert all(r["out_replicated"] for r in reports)


def test_slot_buckets_start_at_the_data_axis_and_nothing_recompiles(reports):
    for r in reports:
        data = r["mesh"][0]
        assert r["buckets"][0] == data and all(b % data == 0 for b in r["buckets"])
        assert r["plan_slots"] == SHAPES["max_slots"]
        # one decode program for the bucket in use, and its sampling program
        assert r["step_compiles"] <= 2


if __name__ == "__main__":
    child_main(json.loads(sys.argv[1]))
