"""The CPU int8 matmul kernel (`metrale_jax/kernels/`) and its use by `models/quant.py`.

Bound: the kernel and the float64 reference `(x @ q) * scale` differ by float32 rounding
only: each output is a sum of K products accumulated in float32 (in another order than
numpy's), so `|y - ref| <= K * eps32 * sum_k |x_k| |q_kn| * scale_n` (the classic bound for
recursive summation, `gamma_K`, products exact enough at these magnitudes), times 2 for the
scale's multiply and the conversions.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest

from metrale_jax.kernels import build, int8_matmul
from metrale_jax.models.quant import KERNEL_MAX_ROWS, qeinsum, qmatmul

pytestmark = pytest.mark.skipif(not int8_matmul.available(),
                                reason="no C++ compiler: the XLA form is used (tested below)")

EPS = float(np.finfo(np.float32).eps)
K, N = 37, 101  # not multiples of the vector width (16) nor of the panel (4 rows)


def operands(m: int, k: int, n: int, seed: int = 0) -> tuple[np.ndarray, ...]:
    """x [m, k] float32, q [k, n] int8 over its whole range, scale [n] float32."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, k)).astype(np.float32)
    q = rng.integers(-127, 128, (k, n)).astype(np.int8)
    scale = rng.uniform(0.001, 0.02, n).astype(np.float32)
    return x, q, scale


def assert_close(y: np.ndarray, x: np.ndarray, q: np.ndarray, scale: np.ndarray) -> None:
    """`y` equals `(x @ q) * scale` (q [K, N]) within the float32 rounding bound above."""
    x64, q64 = x.astype(np.float64), q.astype(np.float64)
    ref = (x64 @ q64) * scale
    bound = 2 * x.shape[-1] * EPS * (np.abs(x64) @ np.abs(q64)) * scale
    assert y.shape == ref.shape and y.dtype == np.float32
    assert np.all(np.abs(y - ref) <= bound + 1e-30)


@pytest.mark.parametrize("transposed", [False, True], ids=["q[K,N]", "q[N,K]"])
@pytest.mark.parametrize("m", [1, 3, 5, 17, 64])
def test_kernel_matches_reference(m: int, transposed: bool) -> None:
    x, q, scale = operands(m, K, N)
    w = np.ascontiguousarray(q.T) if transposed else q
    y = jax.jit(int8_matmul.int8_matmul, static_argnums=3)(x, w, scale, transposed)
    assert_close(np.asarray(y), x, q, scale)


@pytest.mark.parametrize("transposed", [False, True], ids=["q[K,N]", "q[N,K]"])
def test_a_row_gives_the_same_bits_in_any_number_of_rows(transposed: bool) -> None:
    """Rows are grouped in passes of 4 (5 when 5 are left): each row's result is the same
    bits whatever the call's row count."""
    x, q, scale = operands(13, 600, 200, seed=2)
    w = np.ascontiguousarray(q.T) if transposed else q
    run = jax.jit(int8_matmul.int8_matmul, static_argnums=3)
    full = np.asarray(run(x, w, scale, transposed))
    for m in (1, 4, 5, 6, 9):
        np.testing.assert_array_equal(np.asarray(run(x[:m], w, scale, transposed)), full[:m])


def test_kernel_wide_rows() -> None:
    """A K over the vector width with a tail (600 = 37 * 16 + 8), N of several thread blocks."""
    x, q, scale = operands(2, 600, 1000, seed=1)
    assert_close(np.asarray(jax.jit(int8_matmul.int8_matmul)(x, q, scale)), x, q, scale)
    y = jax.jit(int8_matmul.int8_matmul, static_argnums=3)(x, np.ascontiguousarray(q.T),
                                                           scale, True)
    assert_close(np.asarray(y), x, q, scale)


def uses_kernel(fn, *args) -> bool:
    """Whether the lowered `fn(*args)` calls the kernel."""
    return "metrale_int8_matmul" in jax.jit(fn).lower(*args).as_text()


SPECS = {  # qeinsum spec -> (x shape, w shape, scale shape)
    "bte,ehd->bthd": ((1, 3, 8), (8, 2, 5), (2, 5)),
    "bte,ekd->btkd": ((2, 1, 8), (8, 1, 5), (1, 5)),
    "bthd,hde->bte": ((1, 3, 2, 5), (2, 5, 7), (7,)),
    "...e,ve->...v": ((1, 3, 8), (11, 8), (11,)),
}


@pytest.mark.parametrize("spec", list(SPECS))
def test_qeinsum_uses_kernel(spec: str) -> None:
    """Each spec of `models/layers.py` runs the kernel and matches the dequantized einsum."""
    xs, ws, ss = SPECS[spec]
    rng = np.random.default_rng(2)
    x = rng.standard_normal(xs).astype(np.float32)
    w = rng.integers(-127, 128, ws).astype(np.int8)
    scale = rng.uniform(0.001, 0.02, ss).astype(np.float32)
    assert uses_kernel(lambda a, b, c: qeinsum(spec, a, b, c), x, w, scale)
    y = np.asarray(jax.jit(lambda a, b, c: qeinsum(spec, a, b, c))(x, w, scale))
    ref = np.einsum(spec, x.astype(np.float64), w.astype(np.float64))
    ref = ref * scale.reshape((1,) * (ref.ndim - scale.ndim) + scale.shape)
    absum = np.einsum(spec, np.abs(x.astype(np.float64)), np.abs(w.astype(np.float64)))
    bound = 2 * 10 * EPS * absum * scale.reshape((1,) * (ref.ndim - scale.ndim) + scale.shape)
    assert y.shape == ref.shape and np.all(np.abs(y - ref) <= bound + 1e-30)


def test_qeinsum_above_the_cutoff_uses_xla() -> None:
    """Each spec with more than `KERNEL_MAX_ROWS` rows (a prefill chunk) takes XLA's form
    (convert, then a float32 dot) and equals the dequantized einsum within float32 rounding."""
    rng = np.random.default_rng(5)
    T = KERNEL_MAX_ROWS + 1
    for spec, (xs, ws, ss) in SPECS.items():
        x = rng.standard_normal((1, T, *xs[2:])).astype(np.float32)
        w = rng.integers(-127, 128, ws).astype(np.int8)
        scale = rng.uniform(0.001, 0.02, ss).astype(np.float32)
        fn = jax.jit(lambda a, b, c, spec=spec: qeinsum(spec, a, b, c))
        assert not uses_kernel(fn, x, w, scale)
        y = np.asarray(fn(x, w, scale))
        s = scale.reshape((1,) * (y.ndim - scale.ndim) + scale.shape)
        ref = np.einsum(spec, x.astype(np.float64), w.astype(np.float64)) * s
        absum = np.einsum(spec, np.abs(x.astype(np.float64)), np.abs(w.astype(np.float64)))
        assert y.shape == ref.shape and np.all(np.abs(y - ref) <= 2 * 10 * EPS * absum * s)


def test_qmatmul_rows_threshold_and_disabled(monkeypatch: pytest.MonkeyPatch) -> None:
    """Up to `KERNEL_MAX_ROWS` rows use the kernel, more use XLA's form; so does
    METRALE_INT8_KERNEL=0 (the fallback), with the same values within rounding."""
    x, q, scale = operands(KERNEL_MAX_ROWS + 1, K, N, seed=3)
    assert uses_kernel(qmatmul, x[:KERNEL_MAX_ROWS], q, scale)
    assert not uses_kernel(qmatmul, x, q, scale)
    assert_close(np.asarray(jax.jit(qmatmul)(x, q, scale)), x, q, scale)
    monkeypatch.setenv("METRALE_INT8_KERNEL", "0")
    assert not int8_matmul.available()
    assert not uses_kernel(qmatmul, x[:4], q, scale)
    assert_close(np.asarray(jax.jit(qmatmul)(x[:4], q, scale)), x[:4], q, scale)


def test_kernel_in_scan() -> None:
    """Inside jit and lax.scan over stacked layers (the model's layer loop)."""
    x, q, scale = operands(3, 16, 16, seed=4)
    qs, scales = np.stack([q, q[::-1]]), np.stack([scale, scale[::-1]])

    def layers(x, qs, scales):
        return jax.lax.scan(lambda h, w: (qmatmul(h, w[0], w[1]), None), x, (qs, scales))[0]

    assert uses_kernel(layers, x, qs, scales)
    y = np.asarray(jax.jit(layers)(x, qs, scales))
    ref = x.astype(np.float64)
    for i in range(2):
        ref = (ref @ qs[i].astype(np.float64)) * scales[i]
    np.testing.assert_allclose(y, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())


def test_build_failure_falls_back(tmp_path, monkeypatch: pytest.MonkeyPatch, caplog) -> None:
    """A compiler that fails: `build` raises and leaves no file; loading logs one warning and
    answers False (callers keep the XLA form)."""
    monkeypatch.setenv("METRALE_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", "false")  # the coreutils program: exits 1
    with pytest.raises(build.BuildError):
        build.build(int8_matmul.SOURCE)
    assert list(tmp_path.iterdir()) == []
    assert int8_matmul._load.__wrapped__() is False
    assert "int8_matmul unavailable, int8 matmuls use XLA" in caplog.text


PERSISTENT = textwrap.dedent("""
    import jax, numpy as np
    hits = []
    jax.monitoring.register_event_listener(
        lambda event, **kw: hits.append(event) if event.endswith("cache_hits") else None)
    jax.config.update("jax_compilation_cache_dir", {cache!r})
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    from metrale_jax.models.quant import qmatmul
    x = np.arange(6, dtype=np.float32).reshape(2, 3)  # numpy inputs: one program only
    q = np.asarray([[1, -2], [3, 4], [-5, 6]], np.int8)
    y = jax.jit(qmatmul)(x, q, np.asarray([0.5, 2.0], np.float32))
    print(len(hits), np.asarray(y).tolist())
""")


def test_persistent_cache_fresh_process(tmp_path) -> None:
    """A program with the kernel stored in JAX's persistent compilation cache loads and runs
    in a fresh process (the target is registered while tracing, before the cache lookup)."""
    script = PERSISTENT.format(cache=str(tmp_path / "jax_cache"))
    runs = [subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                           check=True, env=os.environ.copy()).stdout.strip().split(maxsplit=1)
            for _ in range(2)]
    expected = str([[-3.5, 32.0], [-5.0, 80.0]])
    assert runs[0] == ["0", expected]  # compiled and stored
    assert runs[1] == ["1", expected]  # loaded from the cache
