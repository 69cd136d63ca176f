"""Mesh strings, the default mesh, and the logical-axis rules (in process: no devices needed).

The runs on 8 fake devices are in test_sharding_mesh.py.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from metrale_jax.config import ModelConfig
from metrale_jax.engine import sharding
from metrale_jax.errors import InvalidParameterError
from metrale_jax.models.ragged import PAGE_AXES
from metrale_jax.models.transformer import Transformer, abstract_model
from metrale_jax.models.unrolled import split_layers

TINY = ModelConfig("llama", vocab_size=512, hidden_size=64, intermediate_size=128,
                   num_layers=2, num_heads=8, num_kv_heads=2, head_dim=16)
SMOLLM = dataclasses.replace(TINY, vocab_size=49152, hidden_size=576, intermediate_size=1536,
                             num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64)
EVERY_FLAG = dict(attention_bias=True, qk_norm=True, post_norms=True)


@pytest.mark.parametrize(("spec", "shape"), [
    ("data=2,model=4", (2, 4)), ("model=4,data=2", (2, 4)), (" data = 8 ", (8, 1)),
    ("model=8", (1, 8)), ("data=1,model=1", (1, 1)),
])
def test_parse_mesh(spec, shape):
    assert sharding.parse_mesh(spec) == shape
    assert sharding.parse_mesh(sharding.format_mesh(shape)) == shape


@pytest.mark.parametrize(("spec", "why"), [
    ("", "empty"), ("   ", "empty"), ("data=2;model=4", "cannot read"),
    ("data=2,tensor=4", "unknown axis 'tensor'"), ("data=2,data=4", "given twice"),
    ("model=0", "at least 1"), ("model=-2", "cannot read"), ("model=two", "cannot read"),
    ("2x4", "cannot read"), ("data=2,", "cannot read"),
])
def test_parse_mesh_rejects(spec, why):
    with pytest.raises(InvalidParameterError, match=why) as e:
        sharding.parse_mesh(spec)
    assert e.value.param == "mesh"
    assert "data=2,model=4" in e.value.message  # says what a good value looks like


def test_parse_mesh_checks_the_device_count():
    assert sharding.parse_mesh("data=2,model=4", n_devices=8) == (2, 4)
    assert sharding.parse_mesh("model=4", n_devices=8) == (1, 4)  # a subset is fine
    with pytest.raises(InvalidParameterError, match="needs 16 devices, but 8 are visible"):
        sharding.parse_mesh("data=2,model=8", n_devices=8)


@pytest.mark.parametrize(("heads", "kv", "n", "shape"), [
    (8, 8, 8, (1, 8)),     # everything divides: all on model
    (8, 2, 8, (4, 2)),     # kv heads limit model to 2
    (9, 3, 8, (8, 1)),     # SmolLM2: nothing divides 8 but 1
    (12, 4, 8, (2, 4)),
    (64, 8, 16, (2, 8)),   # a 70B on 16 chips
    (32, 8, 1, (1, 1)),
    (9, 3, 6, (2, 3)),     # 3 divides 6, 9 and 3
])
def test_default_mesh_shape(heads, kv, n, shape):
    cfg = dataclasses.replace(TINY, num_heads=heads, num_kv_heads=kv)
    got, why = sharding.default_mesh_shape(cfg, n)
    assert got == shape
    assert f"num_heads={heads}" in why and f"num_kv_heads={kv}" in why
    assert (f"all {n} devices on model" in why) == (shape == (1, n))


def test_default_mesh_shape_needs_devices():
    with pytest.raises(InvalidParameterError):
        sharding.default_mesh_shape(TINY, 0)


def test_partition_spec_rules():
    mesh = {"data": 2, "model": 4}
    cache = ("slots", "kv_heads", "seq", "head_dim")
    # kv heads divide the model axis: sharded with the slots
    assert sharding.partition_spec(cache, mesh, (8, 8, 16, 64)) == P("data", "model", None, None)
    # kv heads fewer than the model axis (2 < 4) or not dividing (6 on 4): replicated
    assert sharding.partition_spec(cache, mesh, (8, 2, 16, 64)) == P("data", None, None, None)
    assert sharding.partition_spec(cache, mesh, (8, 6, 16, 64)) == P("data", None, None, None)
    # slots not divisible by data: replicated too
    assert sharding.partition_spec(cache, mesh, (3, 8, 16, 64)) == P(None, "model", None, None)
    # a mesh axis of size 1 is never named; without a shape only the rules apply
    assert sharding.partition_spec(cache, {"data": 1, "model": 4}) == P(None, "model", None, None)
    # an axis already used by an earlier dimension stays replicated
    assert sharding.partition_spec(("heads", "mlp"), mesh, (8, 8)) == P("model", None)
    with pytest.raises(ValueError, match="do not match"):
        sharding.partition_spec(cache, mesh, (8, 8, 16))


def test_shard_shape():
    sizes = {"data": 2, "model": 4}
    assert sharding.shard_shape((8, 8, 16, 64), P("data", "model"), sizes) == (4, 2, 16, 64)
    assert sharding.shard_shape((8, 64), P(("data", "model"), None), sizes) == (1, 64)
    assert sharding.shard_shape((5,), P(), sizes) == (5,)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma2"])
def test_every_param_of_every_layout_has_axes(arch):
    cfg = dataclasses.replace(TINY, architecture=arch, tie_word_embeddings=arch != "llama",
                              **EVERY_FLAG)
    _, stacked = abstract_model(cfg)
    mesh = {"data": 2, "model": 4}
    specs = sharding.param_specs(stacked, mesh)
    flat = {jax.tree_util.keystr(k): v for k, v in
            jax.tree_util.tree_flatten_with_path(specs, is_leaf=lambda x: isinstance(x, P))[0]}
    assert len(flat) == len(jax.tree.leaves(stacked))
    q = next(v for k, v in flat.items() if "'q_proj'" in k)
    kproj = next(v for k, v in flat.items() if "'k_proj'" in k)
    down = next(v for k, v in flat.items() if "'down'" in k)
    embed = next(v for k, v in flat.items() if k.startswith("['embed']"))
    assert q == P(None, None, "model", None)         # [L, E, H, D]: 8 heads over 4
    assert kproj == P(None, None, None, None)        # 2 kv heads < 4: replicated
    assert down == P(None, "model", None)            # [L, F, E]
    assert embed == P("model", None)                 # [V, E]
    # the pure dict (orbax's layout) maps the same
    assert sharding.param_specs(nnx.to_pure_dict(stacked), mesh)["blocks"]["attn"]["q_proj"] == q


def test_layer_params_shardings_on_one_device():
    graphdef, params = nnx.split(Transformer(TINY, rngs=nnx.Rngs(0)))
    _, layers = split_layers(graphdef, params)
    mesh = sharding.make_mesh()
    placed = sharding.shard_params(layers, mesh)
    q = placed.layers[1]["attn"]["q_proj"][...]
    assert q.sharding.mesh.shape == {"data": 1, "model": 1}
    assert (q == layers.layers[1]["attn"]["q_proj"][...]).all()
    abstract = sharding.abstract_params(layers, mesh)
    leaves = jax.tree.leaves(abstract)
    assert len(leaves) == len(jax.tree.leaves(layers))
    assert all(isinstance(x, jax.ShapeDtypeStruct) and x.sharding is not None for x in leaves)


def test_unknown_param_is_a_loud_error():
    bogus = {"blocks": {"attn": {"r_proj": jnp.zeros((2, 4))}}}
    with pytest.raises(ValueError, match="blocks/attn/r_proj"):
        sharding.param_specs(bogus, {"data": 1, "model": 2})


def test_make_mesh_checks_the_device_count():
    assert sharding.make_mesh().shape == {"data": 1, "model": 1}
    n = len(jax.devices())
    with pytest.raises(InvalidParameterError, match=f"needs {2 * n} devices"):
        sharding.make_mesh(2, n)


def test_cache_shardings():
    """The production caches: each layer's page pool `[N, ps, 2K, D]` and the per-slot arrays."""
    mesh = sharding.make_mesh()
    pool = sharding.page_pool_sharding(SMOLLM, 64, 16, mesh)
    assert pool.spec == P(None, None, None, None)  # one device: nothing to shard
    # kv pairs on model where SmolLM2's 3 kv heads divide it (model=3), else replicated;
    # pages are shared by every row, so never split over data
    pool_shape = (64, 16, SMOLLM.num_kv_heads, SMOLLM.head_dim)
    assert sharding.partition_spec(PAGE_AXES, {"data": 2, "model": 3},
                                   pool_shape) == P(None, None, "model", None)
    assert sharding.partition_spec(PAGE_AXES, {"data": 2, "model": 4},
                                   pool_shape) == P(None, None, None, None)
    # slots shard over data; 3 kv heads replicate on model=4
    assert sharding.partition_spec(("slots", None), {"data": 2, "model": 4},
                                   (8, 1)) == P("data", None)
    assert sharding.partition_spec(("layers", "slots", "kv_heads", "seq", "head_dim"),
                                   {"data": 2, "model": 4},
                                   (30, 8, 3, 64, 64)) == P(None, "data", None, None, None)
    assert sharding.slot_sharding(8, mesh, trailing=1).spec == P(None, None)
