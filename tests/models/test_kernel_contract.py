"""JAX's Pallas TPU kernel's contract, checked on CPU (`models/accelerator_attention.py`).

- The layout a step hands the kernel (`kernel_layout` over our pool `[N, ps, 2K, D]`), read by
  JAX's `ref_ragged_paged_attention`, gives our XLA tiers' output: decode rows (one idle),
  pieces after their context, a fresh prompt and padding, with GQA, head_dim 64 and 128, page
  sizes 16 and 32, a sliding window and a soft cap.
- The real kernel in Pallas interpret mode on the CPU, through the public entry point
  (`pltpu.force_tpu_interpret_mode`): TPU interpret mode and the generic HLO interpreter.
  JAX 0.10.2 interprets neither (TPU interpret mode has no rule for the kernel's
  `kv_bufs.at[i].reshape(...)`: "'ReshapeTransform' object has no attribute 'indices'"; the
  HLO interpreter's masked-store discharge fails on "'TypedInt' object has no attribute
  'shape'"), so that check skips there, naming the error, and runs where a JAX can.
- Every precondition the kernel states raises a ValueError naming the model's value before
  the call; a model that does not fit runs the XLA path on TPU (the switch forced here).
- The `shard_map` over kv heads on 8 fake devices (a child process) gives the unsharded
  result, around the XLA path (the kernel cannot run on CPU here). Not around the
  interpreted kernel: TPU interpret mode under `shard_map` on 8 fake CPU devices deadlocked
  here (its threads waiting in `_allocate_buffer` and `_barrier`) in one run of two.
"""

from __future__ import annotations

import logging
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ref_ragged_paged_attention

from metrale_jax.models import accelerator_attention as acc
from metrale_jax.models import paged_attention as pa
from metrale_jax.models.ragged import kernel_layout
from tests.fake_devices import print_report, run_child

pytestmark = pytest.mark.accelerator

# JAX's interpreters' known failures on this kernel (any other error fails the test).
INTERPRETER_LIMITS = ("ReshapeTransform", "TypedInt")

rpa = jax.jit(pa.ragged_paged_attention, static_argnames=(
    "sm_scale", "sliding_window", "soft_cap", "mask_value", "num_decode"))


def mixed_step(seed: int, *, K: int = 4, G: int = 2, D: int = 128, ps: int = 16,
               pps: int = 4, dtype=jnp.float32):
    """A ragged step as the engine builds it: 3 decode rows (row 1 idle), row 4 continuing
    after 19 positions (5 tokens), rows 5 and 6 fresh (3 and 2 tokens), 2 padding tokens;
    the pool written with the chunk's keys. Returns (q, pool, KernelLayout, n, live mask)."""
    rng = np.random.default_rng(seed)
    B = 8
    N = 1 + B * pps
    table = rng.permutation(np.arange(1, N)).astype(np.int32).reshape(B, pps)
    dec_lens = np.asarray([ps * pps - 3, 0, ps + 1], np.int32)
    n = len(dec_lens)
    rows = [4] * 5 + [5] * 3 + [6] * 2 + [-1] * 2
    pos = [*range(19, 24), 0, 1, 2, 0, 1, 0, 0]
    chunk_rows, chunk_pos = np.asarray(rows, np.int32), np.asarray(pos, np.int32)
    C, H = len(rows), K * G
    pool = jnp.asarray(rng.standard_normal((N, ps, 2 * K, D)), dtype)
    q = jnp.asarray(rng.standard_normal((n + C, H, D)), dtype)
    k, v = (jnp.asarray(rng.standard_normal((C, K, D)), dtype) for _ in range(2))
    real = chunk_rows >= 0
    slots = np.where(real, table[np.maximum(chunk_rows, 0), chunk_pos // ps] * ps
                     + chunk_pos % ps, chunk_pos % ps)
    pool = pa.write_kv(pool, k, v, jnp.asarray(slots, jnp.int32))
    kl = kernel_layout(jnp.asarray(table), jnp.asarray(dec_lens), jnp.asarray(chunk_rows),
                       jnp.asarray(chunk_pos))
    live = np.concatenate([dec_lens > 0, real])
    return q, pool, kl, n, live


def reference(q, pool, kl, **opts) -> np.ndarray:
    """JAX's reference on the layout, padded back to every token (padding rows zero)."""
    ref = np.asarray(ref_ragged_paged_attention(q, pool, kl.kv_lens, kl.page_indices,
                                                kl.cu_q_lens, kl.num_seqs, **opts))
    return np.concatenate([ref, np.zeros((q.shape[0] - ref.shape[0], *ref.shape[1:]),
                                         ref.dtype)])


@pytest.mark.parametrize("D,ps,window,cap", [(64, 16, None, None), (128, 32, 24, 30.0)])
def test_kernel_layout_matches_reference(D, ps, window, cap):
    q, pool, kl, n, live = mixed_step(1, D=D, ps=ps)
    opts = dict(sm_scale=D**-0.5, sliding_window=window, soft_cap=cap)
    ref = reference(q, pool, kl, **opts)
    ours = np.asarray(rpa(q, pool, kl.kv_lens, kl.page_indices, kl.cu_q_lens, kl.num_seqs,
                          num_decode=n, **opts))
    assert int(kl.num_seqs[0]) == n + 3
    np.testing.assert_allclose(ours[live], ref[live], rtol=2e-5, atol=2e-5)


def test_kernel_in_interpret_mode_matches_reference():
    """The real kernel (JAX's source) interpreted on CPU, where this JAX's interpreters can."""
    from jax.experimental.pallas import tpu as pltpu
    if not hasattr(pltpu, "force_tpu_interpret_mode"):
        pytest.skip(f"JAX {jax.__version__}: no pltpu.force_tpu_interpret_mode")
    q, pool, kl, _, live = mixed_step(2, K=4, G=2, D=128, ps=16)
    opts = dict(sm_scale=128**-0.5, sliding_window=24, soft_cap=None)
    ref = reference(q, pool, kl, **opts)
    errors = []
    for mode in (pltpu.InterpretParams(), True):
        try:
            out = acc.tpu_ragged_paged_attention(q, pool, kl.kv_lens, kl.page_indices,
                                                 kl.cu_q_lens, kl.num_seqs, interpret=mode,
                                                 num_kv_pages_per_block=2,
                                                 num_queries_per_block=8, **opts)
            out = np.asarray(out)
        except Exception as e:  # JAX's interpreter limits, named above
            if not any(s in str(e) for s in INTERPRETER_LIMITS):
                raise
            getattr(pltpu, "reset_tpu_interpret_mode_state", lambda: None)()
            errors.append(f"{type(mode).__name__}: {str(e).strip().splitlines()[-1][:160]}")
            continue
        np.testing.assert_allclose(out[live], ref[live], rtol=2e-5, atol=2e-5)
        return
    pytest.skip(f"JAX {jax.__version__} cannot interpret the TPU kernel on CPU: "
                + " | ".join(errors))


# ---- preconditions --------------------------------------------------------------------------
@pytest.mark.parametrize("H,K,D,q_dtype,kv_dtype,shards,kind,needle", [
    (9, 3, 64, "float32", "float32", 1, None, "head_dim=64"),
    (12, 3, 128, "float32", "float32", 1, None, "6 combined kv heads"),
    (12, 3, 128, "bfloat16", "bfloat16", 1, None, "a multiple of 2 whose quotient"),
    (16, 4, 128, "float32", "int8", 1, None, "the KV cache is int8"),
    (10, 4, 128, "float32", "float32", 1, None, "num_heads=10 is not a multiple"),
    (24, 12, 128, "float32", "float32", 4, None, "6 combined kv heads (2 x num_kv_heads) per "
                                                 "device (model=4)"),
    (16, 8, 128, "float32", "float32", 3, None, "does not split over model=3"),
    (16, 4, 128, "float32", "float32", 1, "TPU v3", "TPU v4 or later"),
])
def test_precondition_errors(H, K, D, q_dtype, kv_dtype, shards, kind, needle):
    with pytest.raises(ValueError, match="cannot take this model") as e:
        acc.check_tpu_kernel(H, K, D, 16, q_dtype, kv_dtype, shards=shards, device_kind=kind)
    assert needle in str(e.value)


@pytest.mark.parametrize("H,K,D,dtype,shards", [
    (16, 4, 128, "float32", 1), (32, 8, 128, "bfloat16", 1), (8, 1, 256, "bfloat16", 1),
    (32, 8, 128, "bfloat16", 4), (64, 16, 128, "float32", 2)])
def test_shapes_the_kernel_takes(H, K, D, dtype, shards):
    assert acc.tpu_kernel_problems(H, K, D, 16, dtype, dtype, shards=shards,
                                   device_kind="TPU v5 lite") == []


def test_tpu_generation():
    assert [acc.tpu_generation(k) for k in ("TPU v4", "TPU v5 lite", "TPU v6e", "TPU7x",
                                            "TPU v3", "cpu", "NVIDIA H100")] == [
        4, 5, 6, 7, 3, None, None]


def test_switch_follows_the_backend_and_the_env(monkeypatch):
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    monkeypatch.delenv(acc.TPU_KERNEL_ENV, raising=False)
    assert acc.use_tpu_kernel()
    monkeypatch.setenv(acc.TPU_KERNEL_ENV, "0")
    assert not acc.use_tpu_kernel()
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.delenv(acc.TPU_KERNEL_ENV)
    assert not acc.use_tpu_kernel()


def test_call_preconditions_raise_before_the_kernel():
    q, pool, kl, _, _ = mixed_step(3, D=64)
    args = (q, pool, kl.kv_lens, kl.page_indices, kl.cu_q_lens, kl.num_seqs)
    with pytest.raises(ValueError, match="head_dim=64: the kernel needs a multiple of 128"):
        acc.tpu_ragged_paged_attention(*args, sm_scale=1.0)
    q, pool, kl, _, _ = mixed_step(3, D=128)
    args = (q, pool, kl.kv_lens, kl.page_indices, kl.cu_q_lens, kl.num_seqs)
    with pytest.raises(ValueError, match="sliding_window=0 must be positive"):
        acc.tpu_ragged_paged_attention(*args, sm_scale=1.0, sliding_window=0)
    with pytest.raises(ValueError, match="soft_cap=0.0"):
        acc.tpu_ragged_paged_attention(*args, sm_scale=1.0, soft_cap=0.0)


def test_a_model_the_kernel_cannot_take_runs_the_xla_path_on_tpu(monkeypatch, caplog):
    """The switch forced on (as on TPU): the default model's shape (K=3, head_dim 64) is
    decided at load ("xla", the reasons logged once) and its steps run the XLA path."""
    monkeypatch.setattr(acc, "use_tpu_kernel", lambda: True)
    monkeypatch.setattr(pa, "use_tpu_kernel", lambda: True)
    acc._log_fallback_once.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger=acc.__name__):
            assert acc.attention_path(9, 3, 64, 16, "float32", "float32") == "xla"
            assert acc.attention_path(9, 3, 64, 16, "float32", "float32") == "xla"
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1 and "head_dim=64" in warnings[0], warnings
        assert acc.attention_path(16, 4, 128, 16, "bfloat16", "bfloat16") == "tpu-kernel"
        q, pool, kl, n, live = mixed_step(4, K=3, G=3, D=64)
        opts = dict(sm_scale=0.125, sliding_window=None, soft_cap=None)
        out = np.asarray(rpa(q, pool, kl.kv_lens, kl.page_indices, kl.cu_q_lens, kl.num_seqs,
                             num_decode=n, **opts))
        np.testing.assert_allclose(out[live], reference(q, pool, kl, **opts)[live],
                                   rtol=2e-5, atol=2e-5)
    finally:
        acc.set_kernel_mesh(None)
        acc._log_fallback_once.cache_clear()


# ---- sharding: shard_map over kv heads on 8 fake devices -------------------------------------
def _child() -> dict:
    import functools

    from jax.sharding import NamedSharding, PartitionSpec

    from metrale_jax.engine.sharding import make_mesh
    report: dict = {"devices": jax.device_count()}
    q, pool, kl, n, live = mixed_step(5, K=4, G=2, D=128)
    meta = (kl.kv_lens, kl.page_indices, kl.cu_q_lens, kl.num_seqs)
    opts = dict(sm_scale=128**-0.5, sliding_window=24, soft_cap=20.0)
    xla = functools.partial(pa.ragged_paged_attention, num_decode=n)
    single = np.asarray(jax.jit(functools.partial(xla, **opts))(q, pool, *meta))
    for data, model in ((2, 4), (1, 8)):  # 4 kv heads: split 4 ways; on 8, replicated
        mesh = make_mesh(data, model)
        heads = "model" if 4 % model == 0 else None
        qs = jax.device_put(q, NamedSharding(mesh, PartitionSpec(None, heads, None)))
        ps_ = jax.device_put(pool, NamedSharding(mesh, PartitionSpec(None, None, heads, None)))
        run = jax.jit(lambda q, p, *m, mesh=mesh: acc.tpu_ragged_paged_attention(
            q, p, *m, mesh=mesh, kernel=xla, **opts))
        out = run(qs, ps_, *meta)
        report[f"{data}x{model}"] = dict(
            spec=str(out.sharding.spec),
            err=float(np.abs(np.asarray(out)[live] - single[live]).max()))
    return report


def test_shard_map_over_kv_heads_matches_one_device():
    report = run_child(__file__, "child", timeout=300)
    assert report["devices"] == 8
    assert report["2x4"]["spec"] == str(jax.sharding.PartitionSpec(None, "model", None))
    for mesh in ("2x4", "1x8"):
        assert report[mesh]["err"] < 2e-5, report


if __name__ == "__main__" and sys.argv[1:] == ["child"]:
    print_report(_child())
