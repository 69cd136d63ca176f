"""A `metrale convert` checkpoint restores straight into sharded arrays on a device mesh.

The checkpoint is written here (one device); a subprocess with 8 fake CPU devices
(XLA_FLAGS=--xla_force_host_platform_device_count=8, set before jax is imported) restores it
unsharded and on meshes (2, 4) and (1, 8), in float32 and cast to bfloat16 while reading, and
reports, per param: bit-for-bit equality with the unsharded restore, the sharding, and the
shape of every device's shard (a sharded param never exists whole on any device).
"""

from __future__ import annotations

import sys

import pytest

from tests.fake_devices import print_report, run_child

MESHES = [(2, 4), (1, 8)]


def child_main(path: str) -> None:
    """Restores `path` every way and prints one JSON report."""
    import functools

    import jax
    import numpy as np
    from flax import nnx

    from metrale_jax.engine.sharding import make_mesh, param_shardings, shard_shape
    from metrale_jax.weights.orbax_store import load_orbax

    assert len(jax.devices()) == 8
    report = []
    for dtype in ("float32", "bfloat16"):
        plain = load_orbax(path, dtype)
        want = {jax.tree_util.keystr(k): np.asarray(v) for k, v in
                jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(plain.params))[0]}
        for shape in MESHES:
            mesh = make_mesh(*shape)
            ckpt = load_orbax(path, dtype, shardings=functools.partial(param_shardings,
                                                                         mesh=mesh))
            got = jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(ckpt.params))[0]
            for key, x in got:
                name = jax.tree_util.keystr(key)
                spec = x.sharding.spec
                report.append(dict(
                    dtype=dtype, ckpt_dtype=ckpt.dtype, mesh=list(shape), name=name,
                    shape=list(x.shape), array_dtype=str(x.dtype),
                    equal=bool(x.dtype == want[name].dtype
                               and np.array_equal(np.asarray(x), want[name])),
                    devices=len(x.sharding.device_set), spec=[s for s in spec],
                    mesh_shape=dict(x.sharding.mesh.shape),
                    shard_shapes=sorted({tuple(s.data.shape) for s in x.addressable_shards}),
                    expected_shard=list(shard_shape(x.shape, spec, mesh)),
                    num_shards=len(x.addressable_shards)))
    print_report(report)


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> list[dict]:
    """Converts a tiny Qwen2 (biases included) to orbax and runs the child on it."""
    from devtools.hf_models import build_tiny_checkpoint
    from metrale_jax.weights.checkpoint import load_checkpoint
    from metrale_jax.weights.orbax_store import save_orbax

    hf = build_tiny_checkpoint(tmp_path_factory.mktemp("hf") / "qwen2", "qwen2")
    native = save_orbax(load_checkpoint(hf), tmp_path_factory.mktemp("orbax") / "native")
    return run_child(__file__, str(native), timeout=300)


def test_sharded_restore_is_bit_identical(report):
    assert len({r["name"] for r in report}) >= 12  # every param of the tiny Qwen2
    assert {(r["dtype"], tuple(r["mesh"])) for r in report} == {
        (d, m) for d in ("float32", "bfloat16") for m in MESHES}
    bad = [(r["dtype"], r["mesh"], r["name"]) for r in report if not r["equal"]]
    assert not bad
    assert all(r["array_dtype"] == r["dtype"] == r["ckpt_dtype"] for r in report)


def test_every_param_lands_on_the_whole_mesh_in_shards(report):
    for r in report:
        assert r["devices"] == 8 and r["num_shards"] == 8, r
        assert r["mesh_shape"] == {"data": r["mesh"][0], "model": r["mesh"][1]}
        assert r["shard_shapes"] == [r["expected_shard"]], r  # no device holds more


def test_tensor_parallel_params_are_split(report):
    by = {(tuple(r["mesh"]), r["name"]): r for r in report if r["dtype"] == "float32"}
    # tiny Qwen2: V=1024, E=64, F=128, L=3, H=4, K=2, D=16
    q = by[((2, 4), "['blocks']['attn']['q_proj']")]
    assert q["shape"] == [3, 64, 4, 16] and q["shard_shapes"] == [[3, 64, 1, 16]]
    assert q["spec"] == [None, None, "model", None]
    assert by[((2, 4), "['embed']")]["shard_shapes"] == [[256, 64]]
    assert by[((1, 8), "['blocks']['mlp']['down']")]["shard_shapes"] == [[3, 16, 64]]
    # 2 kv heads on model=4 (and 4 heads on model=8): replicated, as the rules say
    assert by[((2, 4), "['blocks']['attn']['k_proj']")]["shard_shapes"] == [[3, 64, 2, 16]]
    assert by[((1, 8), "['blocks']['attn']['q_proj']")]["shard_shapes"] == [[3, 64, 4, 16]]


if __name__ == "__main__":
    child_main(sys.argv[1])
