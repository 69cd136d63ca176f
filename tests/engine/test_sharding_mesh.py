"""Sharded params and caches on 8 fake CPU devices give the single-device tokens and logits.

One subprocess (XLA_FLAGS=--xla_force_host_platform_device_count=8, set before jax is
imported) runs this file as a script: for each model it runs a greedy prefill and decode steps
through the engine's ragged layers (`models/ragged.py`: a prompt chunk, then decode rows, over
page pools), jitted, once on one device and once per mesh of its `MODEL_MESHES` with params
and page pools placed by `engine/sharding.py`, and
prints a JSON report that the test below checks. Models: random tiny configs whose head counts
divide the model axis (and some that do not: kv heads replicated), a tiny Hugging Face
checkpoint, and the default model (9 heads / 3 kv heads; its first `DEFAULT_MODEL_LAYERS`
layers, real weights) on mesh (2, 4).

"Within 1e-5 relative": `max|a - b| / max|b|` (the fidelity tests' measure) and the Frobenius
`|a - b| / |b|`, over all logits of a phase (prefill, decode). The tiny models meet 1e-5 (the
largest seen, 7e-6, is a decode step on the data-only mesh); the default model's prefill logits
(all 30 layers, 576 wide) do not always (its first 4: within 1.1e-6, floor 2.2e-6). On XLA:CPU
float32 rounding alone moves them by 1-3e-5 (max measure) on ONE device, when nothing but the
batch changes (8 rows at once, or 4, 2 or 1 at a time: other GEMM blocking) or against float64
matmuls (the float32 error itself). A sharded run reorders the same sums (an MLP split over 4
devices adds 4 partial sums), so the bound comes from that floor, measured in the child for
each checkpoint on the same prompts: the largest of those one-device differences times
`NOISE_FACTOR`, where that exceeds 1e-5, for both phases. (The random tiny models are held to
1e-5 itself, without measuring a floor.) The factor is 4: two float32 results that are each
within the floor of the exact one are within 2x the floor of each other, and the sharded runs
have come within 1.8x. A wrong result (a missing reduction, a shard read as another) moves
logits by O(1), four orders of magnitude above the bound (the closing note of issue #13 shows
such a mutation failing).
"""

from __future__ import annotations

import functools
import json
import sys

import pytest

from tests.fake_devices import print_report, run_child

MESHES = [(1, 8), (2, 4), (4, 2), (8, 1)]
B, T, S, STEPS = 8, 8, 16, 4  # rows, prompt tokens, positions per row, decode steps

TINY_BASE = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2,
                 head_dim=16)
RANDOM_MODELS = {
    # every head count divides every model axis
    "llama-h8-k8": dict(architecture="llama", num_heads=8, num_kv_heads=8),
    # kv heads sharded on model=2, replicated on model=4 and 8; biases, q/k norms, tied head
    "qwen3-h8-k2": dict(architecture="qwen3", num_heads=8, num_kv_heads=2, qk_norm=True,
                        attention_bias=True, tie_word_embeddings=True),
    # Gemma 2's extra norms, soft-caps and alternating sliding layers
    "gemma2-h8-k4": dict(architecture="gemma2", num_heads=8, num_kv_heads=4, post_norms=True,
                         norm_weight_offset=True, embed_scale=True, attn_logit_softcap=20.0,
                         final_logit_softcap=15.0, sliding_window=4,
                         sliding_layers=(True, False), query_pre_attn_scalar=16.0,
                         hidden_act="gelu_tanh", tie_word_embeddings=True),
}
# Each model runs on two of the four meshes (every run compiles its own programs); together
# they cover each mesh at least twice but (8, 1), and each case of the sharding rules: heads
# that divide the model axis, kv heads sharded (qwen3 and gemma2 on model=2) and replicated
# (on model=8; the hf model's 4 heads and the default model's 9 on model=4 too).
MODEL_MESHES = {"llama-h8-k8": [(2, 4), (8, 1)], "qwen3-h8-k2": [(4, 2), (1, 8)],
                "gemma2-h8-k4": [(4, 2), (1, 8)], "hf-llama-h4-k2": [(1, 8), (2, 4)],
                "default": [(2, 4)]}
DEFAULT_MODEL_MESHES = MODEL_MESHES["default"]
# The default model's first layers only: its 30 share one shape and one sharding rule, and
# each unrolled layer adds to the compile of every program the child builds (eight for it).
DEFAULT_MODEL_LAYERS = 4


# ---- the child -----------------------------------------------------------------------------
PAGE = 4  # page size: a row's T + STEPS positions span several pages


def _pools(cfg, mesh, dtype):
    """Empty page pools (B rows of S positions, page 0 the null page), placed on `mesh`."""
    import jax
    import jax.numpy as jnp

    from metrale_jax.engine import sharding

    pages = B * S // PAGE + 1
    pools = tuple(jnp.zeros((pages, PAGE, 2 * cfg.num_kv_heads, cfg.head_dim), dtype)
                  for _ in range(cfg.num_layers))
    if mesh is not None:
        pools = jax.device_put(pools, sharding.page_pool_sharding(cfg, pages, PAGE, mesh))
    return pools


def _layout(rows, positions, n: int):
    """The `StepLayout` of a step whose tokens are at `positions` of `rows` (the first `n`
    decode rows, then the prompt chunk); row b owns pages 1 + b * S / PAGE onwards."""
    import jax.numpy as jnp
    import numpy as np

    from metrale_jax.models.ragged import StepLayout

    table = 1 + np.arange(B * S // PAGE, dtype=np.int32).reshape(B, S // PAGE)
    slots = table[rows, positions // PAGE] * PAGE + positions % PAGE
    return StepLayout(slots=jnp.asarray(slots, jnp.int32), dec_table=jnp.asarray(table[:n]),
                      dec_lens=jnp.asarray(positions[:n] + 1, jnp.int32),
                      chunk_rows=jnp.asarray(rows[n:], jnp.int32),
                      page_table=jnp.asarray(table))


@functools.cache
def _step_program(graph, n: int):
    """One ragged step of `graph` (n decode rows, static) -> (logits [T, V], pools)."""
    import jax

    from metrale_jax.models.ragged import head, ragged_layers

    def step(params, pools, tokens, positions, layout):
        x, pools = ragged_layers(graph, params, pools, tokens, positions, layout, n=n)
        return head(graph, params, x), pools

    return jax.jit(step, donate_argnums=(1,))


def _prefill(graph, params, pools, prompts):
    """The prompts `[R, T]` (rows 0 .. R-1) as one chunk -> (logits [R, T, V], pools)."""
    import jax.numpy as jnp
    import numpy as np

    R = len(prompts)
    rows = np.repeat(np.arange(R, dtype=np.int32), T)
    positions = np.tile(np.arange(T, dtype=np.int32), R)
    logits, pools = _step_program(graph, 0)(
        params, pools, jnp.asarray(np.asarray(prompts).reshape(-1), jnp.int32),
        jnp.asarray(positions), _layout(rows, positions, 0))
    return logits.reshape(R, T, -1), pools


def _greedy(graph, params, mesh, prompts):
    """Prefill `prompts` [B, T] then STEPS greedy decode steps, through the engine's ragged
    layers over page pools; params already placed. Returns (prefill logits [B, T, V], decode
    logits [STEPS, B, V], tokens [STEPS + 1, B], number of devices the logits live on)."""
    import jax.numpy as jnp
    import numpy as np

    pools = _pools(graph.cfg, mesh, params.outer["embed"][...].dtype)
    logits, pools = _prefill(graph, params, pools, prompts)
    devices = len(logits.sharding.device_set)
    pre_logits = np.asarray(logits)
    tok = pre_logits[:, -1].argmax(-1).astype(np.int32)
    out_tokens, out_logits = [tok], []
    rows = np.arange(B, dtype=np.int32)
    for step in range(STEPS):
        pos = np.full((B,), T + step, np.int32)
        logits, pools = _step_program(graph, B)(params, pools, jnp.asarray(tok),
                                                jnp.asarray(pos), _layout(rows, pos, B))
        devices = min(devices, len(logits.sharding.device_set))
        logits = np.asarray(logits)
        out_logits.append(logits)
        tok = logits.argmax(-1).astype(np.int32)
        out_tokens.append(tok)
    return pre_logits, np.stack(out_logits), np.stack(out_tokens), devices


def _rel(a, b) -> float:
    import numpy as np
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def _fro(a, b) -> float:
    import numpy as np
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _noise_floor(graph, params, prompts, batch_logits) -> dict[str, float]:
    """How far float32 rounding alone moves the one-device prefill logits `batch_logits`
    ([B, T, V], the prompts run as one batch), as the largest difference of each measure
    (`{"rel": _rel, "fro": _fro}`) to: the same prompts run 4, 2 and 1 at a time (other GEMM
    blocking), and a run with float64 matmuls (the float32 error itself)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    others = []
    for rows in (4, 2, 1):
        others.append(np.concatenate([
            np.asarray(_prefill(graph, params, _pools(graph.cfg, None, jnp.float32),
                                prompts[i:i + rows])[0])
            for i in range(0, len(prompts), rows)]))
    with jax.enable_x64(True):
        wide = jax.tree.map(
            lambda x: x.astype(jnp.float64) if jnp.issubdtype(x.dtype, jnp.floating) else x,
            params)
        others.append(np.asarray(_prefill(graph, wide, _pools(graph.cfg, None, jnp.float64),
                                          prompts)[0], np.float32))
    return {"rel": max(_rel(o, batch_logits) for o in others),
            "fro": max(_fro(o, batch_logits) for o in others)}


def _first_layers(graph, layer_params, layers: int):
    """The model cut to its first `layers` layers (the embedding, final norm and head kept)."""
    import dataclasses

    from metrale_jax.models.unrolled import LayerParams

    cfg = dataclasses.replace(graph.cfg, num_layers=layers)
    return (dataclasses.replace(graph, cfg=cfg),
            LayerParams(layer_params.outer, layer_params.layers[:layers]))


def _check_model(name, graphdef, params, meshes, measure_floor: bool = True,
                 layers: int | None = None):
    """The single-device run vs each mesh: a report dict per mesh, with the one-device noise
    floor of the model's prefill logits (`_noise_floor`), or None without `measure_floor`
    (the random tiny models: their bound is 1e-5 itself, which the floor could only raise).
    layers: run only the model's first `layers` layers (every layer is sharded by the same
    rules; each unrolled layer adds to every program's compile)."""
    import jax
    import numpy as np

    from metrale_jax.engine import sharding
    from metrale_jax.models.unrolled import split_layers

    graph, layer_params = split_layers(graphdef, params)
    if layers is not None and layers < graph.cfg.num_layers:
        graph, layer_params = _first_layers(graph, layer_params, layers)
    cfg = graph.cfg
    rng = np.random.default_rng(0)
    prompts = rng.integers(0, cfg.vocab_size, (B, T))
    ref = _greedy(graph, layer_params, None, prompts)
    floor = _noise_floor(graph, layer_params, prompts, ref[0]) if measure_floor else None
    reports = []
    for shape in meshes:
        mesh = sharding.make_mesh(*shape)
        placed = sharding.shard_params(layer_params, mesh)
        q = placed.layers[0]["attn"]["q_proj"][...]
        got = _greedy(graph, placed, mesh, prompts)

        reports.append(dict(
            model=name, mesh=list(shape), devices=got[3], noise_floor=floor,
            layers=cfg.num_layers,
            prefill_fro=_fro(got[0], ref[0]), decode_fro=_fro(got[1], ref[1]),
            q_proj_spec=list(q.sharding.spec),
            q_proj_shard=list(q.addressable_shards[0].data.shape),
            tokens_equal=bool((got[2] == ref[2]).all()), tokens=got[2].tolist(),
            ref_tokens=ref[2].tolist(), prefill_rel=_rel(got[0], ref[0]),
            decode_rel=_rel(got[1], ref[1])))
        del placed
        jax.clear_caches()
    return reports


def child_main(spec: dict) -> None:
    """Runs every model of `spec` and prints one JSON list of reports."""
    import jax
    from flax import nnx

    from metrale_jax.engine.compilation_cache import enable
    enable(spec["cache_dir"])
    from metrale_jax.config import ModelConfig
    from metrale_jax.models.transformer import Transformer
    from metrale_jax.weights.checkpoint import load_checkpoint

    assert len(jax.devices()) == 8, jax.devices()
    reports = []
    for name, fields in RANDOM_MODELS.items():
        cfg = ModelConfig(**{**TINY_BASE, **fields})
        graphdef, params = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))
        # Larger weights: logits far apart, so a greedy tie cannot hide a wrong result
        # (x3: larger scales make the tiny models chaotic, amplifying float32 rounding).
        params = jax.tree.map(lambda x: x * 3.0 if x.ndim > 1 else x, params)
        reports += _check_model(name, graphdef, params, MODEL_MESHES[name],
                                measure_floor=False)
    for label, path, meshes, layers in spec["checkpoints"]:
        ckpt = load_checkpoint(path)
        reports += _check_model(label, ckpt.graphdef, ckpt.params, [tuple(m) for m in meshes],
                                layers=layers)
    print_report(reports)


# ---- the test ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> list[dict]:
    """Runs the child once for every model and mesh; its parsed JSON report."""
    from devtools.hf_models import build_tiny_checkpoint
    from metrale_jax.weights.default_model import default_model_path
    from tests.conftest import CACHE

    hf = build_tiny_checkpoint(tmp_path_factory.mktemp("hf") / "llama", "llama")
    checkpoints = [["hf-llama-h4-k2", str(hf), MODEL_MESHES["hf-llama-h4-k2"], None]]
    default = default_model_path()
    if default.is_file():
        checkpoints.append(["default", str(default), DEFAULT_MODEL_MESHES, DEFAULT_MODEL_LAYERS])
    spec = dict(checkpoints=checkpoints, cache_dir=str(CACHE))
    return run_child(__file__, json.dumps(spec), timeout=900)


def test_every_model_and_mesh_ran(reports):
    names = {r["model"] for r in reports}
    assert set(RANDOM_MODELS) | {"hf-llama-h4-k2"} <= names
    for name in set(RANDOM_MODELS) | {"hf-llama-h4-k2"}:
        assert (sorted(tuple(r["mesh"]) for r in reports if r["model"] == name)
                == sorted(MODEL_MESHES[name]))
    assert {m for ms in MODEL_MESHES.values() for m in ms} == set(MESHES)
    assert all(r["devices"] == 8 for r in reports), [(r["model"], r["mesh"], r["devices"])
                                                      for r in reports]


def test_greedy_tokens_identical_to_one_device(reports):
    bad = [(r["model"], r["mesh"], r["tokens"], r["ref_tokens"]) for r in reports
           if not r["tokens_equal"]]
    assert not bad


BOUND = 1e-5
NOISE_FACTOR = 4.0  # x the one-device floor measured in the child (see the top)


def logits_bounds(report: dict) -> tuple[float, float]:
    """The (max, Frobenius) bounds of a report's logits: 1e-5, or NOISE_FACTOR times the
    model's one-device noise floor where that is larger (a model measured without one: 1e-5)."""
    floor = report["noise_floor"]
    if floor is None:
        return BOUND, BOUND
    return (max(BOUND, NOISE_FACTOR * floor["rel"]), max(BOUND, NOISE_FACTOR * floor["fro"]))


def test_logits_within_1e5_relative(reports):
    bad = []
    for r in reports:
        rel_bound, fro_bound = logits_bounds(r)
        if not (r["prefill_rel"] <= rel_bound and r["decode_rel"] <= rel_bound
                and r["prefill_fro"] <= fro_bound and r["decode_fro"] <= fro_bound):
            bad.append({k: r[k] for k in ("model", "mesh", "noise_floor", "prefill_rel",
                                          "decode_rel", "prefill_fro", "decode_fro")})
    assert not bad


def test_noise_floors_are_rounding(reports):
    """The floors the bounds scale are float32 rounding, far below a real defect's O(1)."""
    measured = [r for r in reports if r["noise_floor"] is not None]
    assert {r["model"] for r in measured} >= {"hf-llama-h4-k2"}
    assert all(r["noise_floor"] is None for r in reports if r["model"] in RANDOM_MODELS)
    for r in measured:
        assert 0.0 < r["noise_floor"]["rel"] < 1e-3 and 0.0 < r["noise_floor"]["fro"] < 1e-3, r


def test_heads_sharded_where_they_divide(reports):
    by = {(r["model"], tuple(r["mesh"])): r for r in reports}
    # 8 heads over model=4: two per device; q_proj [E, H, D] -> [E, 2, D]
    assert by[("llama-h8-k8", (2, 4))]["q_proj_spec"] == [None, "model", None]
    assert by[("llama-h8-k8", (2, 4))]["q_proj_shard"] == [64, 2, 16]
    assert by[("llama-h8-k8", (8, 1))]["q_proj_shard"] == [64, 8, 16]
    # 4 heads do not divide model=8: replicated
    assert by[("hf-llama-h4-k2", (1, 8))]["q_proj_shard"] == [64, 4, 16]


def test_default_model_on_its_meshes(reports):
    rows = [r for r in reports if r["model"] == "default"]
    if not rows:
        pytest.skip("default model not in checkpoints/; run `metrale pull`")
    assert sorted(tuple(r["mesh"]) for r in rows) == sorted(DEFAULT_MODEL_MESHES)
    for r in rows:  # 9 heads: replicated on every model axis here
        assert r["q_proj_shard"] == [576, 9, 64]
        assert r["layers"] == DEFAULT_MODEL_LAYERS


if __name__ == "__main__":
    child_main(json.loads(sys.argv[1]))
