"""An int8 model (`models/quant.py`) sharded on 8 fake CPU devices computes what it computes on
one device, and its scales shard with their weights' output axes.

One subprocess (XLA_FLAGS=--xla_force_host_platform_device_count=8, set before jax is
imported) runs this file as a script: a tiny llama quantized to int8 runs one forward over
the same tokens on one device, on a data mesh (8, 1) (weights replicated, rows sharded) and on
a tensor-parallel mesh (2, 4) (heads and MLP on "model"). The data mesh gives the
single-device logits bit for bit. The tensor-parallel mesh sums o_proj's and down's partial
products across devices, a different float32 summation order, as it does for the float model
(tests/engine/test_engine_mesh.py compares float greedy tokens for the same reason): its
difference from one device is float32 rounding (measured 3e-6 absolute for the int8 model and
2-3e-6 for the float one), bounded here by 1e-5 of the logits' range, and the greedy tokens
are identical. The same holds for an int8 KV cache (`models/kv_quant.py`): a prompt read
through int8 page pools, replicated on the data mesh and split over the kv heads on the
tensor-parallel one, and for int4 weights (`models/quant4.py`), stored `[out..., in / 2]`
and sharded on their output axes (o_proj and down, whose outputs are E, replicate).
"""

from __future__ import annotations

import pytest

from tests.fake_devices import print_report, run_child

CONFIG = dict(architecture="llama", vocab_size=512, hidden_size=64, intermediate_size=128,
              num_layers=2, num_heads=8, num_kv_heads=8, head_dim=16)


def child_main() -> None:
    """Prints the logits of every run and the specs of a layer's weights and scales."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from devtools.logits import rows_logits
    from metrale_jax.config import ModelConfig
    from metrale_jax.engine.sharding import make_mesh, page_pool_sharding, shard_params
    from metrale_jax.models.quantized_model import quantize_state
    from metrale_jax.models.ragged import sequence_logits
    from metrale_jax.models.transformer import Transformer
    from metrale_jax.models.unrolled import split_layers

    assert len(jax.devices()) == 8, jax.devices()
    cfg = ModelConfig(**CONFIG)
    _, params = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))
    tokens = np.random.default_rng(0).integers(0, 512, (8, 16))
    report: dict = {}
    graph, layers = split_layers(*quantize_state(cfg, params, "int8")[1:])
    report["one"] = rows_logits(graph, layers, tokens).tolist()
    for mesh in [(8, 1), (2, 4)]:
        sharded = shard_params(layers, make_mesh(*mesh))
        report[str(mesh)] = rows_logits(graph, sharded, tokens).tolist()
    # The int8 KV cache: a prompt in two chunks through int8 pools, on one device and with
    # the pools sharded as the engine shards them (kv heads on "model" when they divide it).
    ids = np.random.default_rng(1).integers(0, 512, 40).tolist()
    kv = dict(page_size=8, chunk=16, cache_dtype=jnp.int8)
    report["kv/one"] = np.asarray(sequence_logits(graph, layers, ids, **kv)).tolist()
    for mesh in [(8, 1), (2, 4)]:
        m = make_mesh(*mesh)
        report[f"kv/{mesh}"] = np.asarray(sequence_logits(
            graph, shard_params(layers, m), ids, **kv,
            pool_sharding=page_pool_sharding(cfg, 1, 8, m))).tolist()
    layer = sharded.layers[0]  # on (2, 4)
    # int4 weights (models/quant4.py): stored [out..., in / 2], sharded on their output axes.
    graph4, layers4 = split_layers(*quantize_state(cfg, params, "int4")[1:])
    report["int4/one"] = rows_logits(graph4, layers4, tokens).tolist()
    for mesh in [(8, 1), (2, 4)]:
        sharded4 = shard_params(layers4, make_mesh(*mesh))
        report[f"int4/{mesh}"] = rows_logits(graph4, sharded4, tokens).tolist()
    report["int4/specs"] = {
        f"{m}/{w}": [str(x) for x in sharded4.layers[0][m][w][...].sharding.spec]
        for m, ws in (("attn", ("q_proj", "q_proj_scale", "o_proj", "o_proj_scale")),
                      ("mlp", ("gate", "gate_scale", "down", "down_scale")))
        for w in ws}
    report["specs"] = {
        f"{m}/{w}": [str(x) for x in layer[m][w][...].sharding.spec]
        for m, ws in (("attn", ("q_proj", "q_proj_scale", "o_proj", "o_proj_scale")),
                      ("mlp", ("gate", "gate_scale", "down", "down_scale")))
        for w in ws}
    print_report(report)


@pytest.fixture(scope="module")
def report() -> dict:
    return run_child(__file__, "{}", timeout=600)


def _check_meshes(report: dict, prefix: str) -> None:
    """The data mesh's logits equal one device's bit for bit; the tensor-parallel mesh's are
    within float32 rounding (1e-5 of the range) and give the same argmaxes."""
    import numpy as np
    one = np.asarray(report[f"{prefix}one"])
    np.testing.assert_array_equal(np.asarray(report[f"{prefix}(8, 1)"]), one)  # bit for bit
    tp = np.asarray(report[f"{prefix}(2, 4)"])
    assert np.abs(tp - one).max() <= 1e-5 * np.abs(one).max()
    assert (tp.argmax(-1) == one.argmax(-1)).all()


def test_sharded_int8_equals_one_device(report):
    _check_meshes(report, "")


def test_int8_kv_cache_sharded_equals_one_device(report):
    _check_meshes(report, "kv/")


def test_sharded_int4_equals_one_device(report):
    _check_meshes(report, "int4/")


def test_int4_weights_shard_on_their_output_axes(report):
    specs = report["int4/specs"]
    assert specs["attn/q_proj"] == ["model", "None", "None"]  # [H, D, E / 2]
    assert specs["attn/q_proj_scale"] == ["model", "None", "None", "None"]  # [H, D, E/32, 2]
    assert specs["attn/o_proj"] == ["None", "None"]           # [E, H*D / 2]: replicated
    assert specs["mlp/gate"] == ["model", "None"] and specs["mlp/down"] == ["None", "None"]
    assert specs["mlp/gate_scale"] == ["model", "None", "None"]


def test_scales_shard_with_their_weights_output_axes(report):
    specs = report["specs"]
    assert specs["attn/q_proj"] == ["None", "model", "None"]  # [E, H, D]: heads on model
    assert specs["attn/q_proj_scale"] == ["model", "None"]    # [H, D]
    assert specs["attn/o_proj"] == ["model", "None", "None"]  # [H, D, E]
    assert specs["attn/o_proj_scale"] == ["None"]             # [E]: replicated
    assert specs["mlp/gate"] == ["None", "model"] and specs["mlp/gate_scale"] == ["model"]
    assert specs["mlp/down"] == ["model", "None"] and specs["mlp/down_scale"] == ["None"]


if __name__ == "__main__":
    child_main()
