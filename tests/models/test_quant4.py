"""int4 weight-only quantization (`models/quant4.py`) and its CPU kernel
(`kernels/int4_matmul.py`): the round trip bound, llama.cpp's Q4_1 blocks kept exactly, the
kernel against its own arithmetic and against the float product, the products of
`models/layers.py`, and the logits of a model against float32.

Tolerances come from the formats, not from a run:
- weights: `|w - (d * code + m)| <= d / 2` (round to nearest), plus float16's rounding of
  d and m (relative 2^-11 each: `15 d + |m|` of it at the block's ends);
- the kernel quantizes each block of 32 activations to int8 (`sx = max|x| / 127`, as
  llama.cpp's Q8): its integer dot products are exact and the rest is float32 rounding of a
  few terms per block, so it equals its own formula (re-derived here in float64) within
  `4 (K / 32 + 16) eps32` of the sum of the terms' magnitudes; against the float product
  `x @ w^T` it is off by the activations' rounding, at most `sx / 2 * sum |w|` per block;
- a model: XLA's form (the dequantized weight's float dot) equals the float model run on the
  dequantized weights within 1e-5 of the logits' range; the kernel's forward differs from it
  by the activations' rounding, to first order at most `1/254` of the logits' scale per
  product on a token's path; and against float32 each int4 product adds to first order at
  most `1/15` (half a step of a block spanning +-max|w|: `(2 max / 15) / 2`), the int8 head
  `1/254`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from devtools.logits import stacked_logits
from metrale_jax.kernels import int4_matmul
from metrale_jax.models.quant import KERNEL_MAX_ROWS_INT4, SCALE_SUFFIX, qeinsum, qmatmul
from metrale_jax.models.quant4 import BLOCK, dequantize4, quantize4
from metrale_jax.models.quantized_model import quantize_state
from tests.models.test_quant import TOKENS, load_quantized_gguf, random_model

EPS = float(np.finfo(np.float32).eps)
F16 = 2.0 ** -11  # float16's relative rounding

kernel = pytest.mark.skipif(not int4_matmul.available(),
                            reason="no C++ compiler: the XLA form is used (tested below)")

LAYOUTS = {  # float shape, input axes -> packed shape (the other axes, then K / 2)
    "q_proj [E, H, D]": ((64, 4, 16), (0,), (4, 16, 32)),
    "o_proj [H, D, E]": ((4, 16, 64), (0, 1), (64, 32)),
    "down [F, E]": ((128, 64), (0,), (64, 64)),
    "stacked q_proj [L, E, H, D]": ((2, 96, 4, 16), (1,), (2, 4, 16, 48)),
}


def inputs_last(w: np.ndarray, in_axes: tuple[int, ...]) -> np.ndarray:
    """`w` with its input axes moved last and flattened: the weight `dequantize4` returns."""
    rest = [a for a in range(w.ndim) if a not in in_axes]
    moved = np.transpose(w, (*rest, *in_axes))
    return moved.reshape(*moved.shape[:len(rest)], -1)


# ---- the representation -------------------------------------------------------------------
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_round_trip_within_half_a_step(layout):
    shape, in_axes, packed = LAYOUTS[layout]
    rng = np.random.default_rng(0)
    w = rng.standard_normal(shape).astype(np.float32) * rng.uniform(0.01, 3.0, shape[-1])
    q, dm = quantize4(w, in_axes)
    assert q.dtype == np.uint8 and q.shape == packed
    assert dm.dtype == np.float16 and dm.shape == (*packed[:-1], packed[-1] * 2 // BLOCK, 2)
    flat = inputs_last(w, in_axes)
    err = np.abs(flat - dequantize4(q, dm))
    d = np.repeat(dm[..., 0].astype(np.float32), BLOCK, axis=-1)
    m = np.repeat(dm[..., 1].astype(np.float32), BLOCK, axis=-1)
    bound = d / 2 + (15 * d + np.abs(m)) * F16
    assert np.all(err <= bound * (1 + 1e-6)), float((err - bound).max())
    # each block's minimum takes code 0 and its maximum code 15: the whole 4-bit range
    codes = np.concatenate([q.reshape(*q.shape[:-1], -1, 16) & 15,
                            q.reshape(*q.shape[:-1], -1, 16) >> 4], axis=-1)
    assert np.all(codes.min(-1) == 0) and np.all(codes.max(-1) == 15)
    qj, dmj = quantize4(jnp.asarray(w), in_axes)  # the jax path (model init) agrees
    np.testing.assert_array_equal(np.asarray(qj), q)
    np.testing.assert_array_equal(np.asarray(dmj), dm)


def test_llama_cpp_q4_1_blocks_come_back_exactly():
    """Quantizing the values of llama.cpp Q4_1 blocks gives back their bytes: the codes, d and
    m, so a Q4_1 GGUF loads as int4 without any further loss."""
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import dequantize, quantize
    rng = np.random.default_rng(1)
    w = (rng.standard_normal((24, 160)) * rng.uniform(0.01, 2.0, (24, 1))).astype(np.float32)
    raw = quantize(w, Q.Q4_1)  # [N, blocks * 20]: per block d, m (float16), 16 code bytes
    blocks = raw.reshape(24, -1, 20)
    values = dequantize(raw, Q.Q4_1).astype(np.float32)  # [N, K], what the file holds
    q, dm = quantize4(values.T, (0,))
    np.testing.assert_array_equal(q.reshape(24, -1, 16), blocks[..., 4:])
    np.testing.assert_array_equal(dm.view(np.uint8).reshape(24, -1, 4), blocks[..., :4])
    np.testing.assert_array_equal(dequantize4(q, dm), values)


def test_gguf_q4_1_file_loads_as_its_own_int4_values(tmp_path):
    """A GGUF of Q4_1 tensors read with quantization "int4": every linear weight dequantizes
    to the file's values exactly."""
    from gguf import GGMLQuantizationType as Q

    spec, exact, pure = load_quantized_gguf(tmp_path, Q.Q4_1, "int4")
    q, dm = pure["blocks"]["mlp"]["down"], pure["blocks"]["mlp"]["down_scale"]
    assert q.dtype == jnp.uint8 and dm.dtype == jnp.float16
    want = np.stack([exact[f"model.layers.{i}.mlp.down_proj.weight"] for i in range(spec.L)])
    np.testing.assert_array_equal(dequantize4(np.asarray(q), np.asarray(dm)), want)
    assert pure["embed"].dtype == jnp.int8  # the embedding and head: int8 per row


# ---- the kernel -----------------------------------------------------------------------------
def operands(m: int, k: int, n: int, seed: int = 0) -> tuple[np.ndarray, ...]:
    """x [m, k] float32 (rows of different scales), and w [k, n]'s int4 `(q, dm)`."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((m, k)) * rng.uniform(0.1, 10.0, (m, 1))).astype(np.float32)
    q, dm = quantize4(rng.standard_normal((k, n)).astype(np.float32), (0,))
    return x, q, dm


def kernel_terms(x: np.ndarray, q: np.ndarray, dm: np.ndarray) -> np.ndarray:
    """The kernel's formula in float64, term by term `[M, N, blocks, 2]`: per block
    `d * sx * (codes . xq)` and `m * sx * sum(xq)`, with x quantized as the kernel does
    (float32 `sx = max|x| / 127`, `xq = round-half-even(x * (1 / sx))`)."""
    M, K = x.shape
    xb = x.reshape(M, K // BLOCK, BLOCK)
    sx = (np.abs(xb).max(-1) / np.float32(127)).astype(np.float32)
    inv = np.where(sx > 0, np.float32(1) / np.where(sx > 0, sx, 1), 0).astype(np.float32)
    xq = np.rint((xb * inv[..., None]).astype(np.float32)).astype(np.float64)
    blocks = q.reshape(q.shape[0], -1, 16)
    codes = np.concatenate([blocks & 15, blocks >> 4], -1).astype(np.float64)  # [N, B, 32]
    dots = np.einsum("mbi,nbi->mnb", xq, codes)
    d, m = dm[..., 0].astype(np.float64), dm[..., 1].astype(np.float64)
    sx64 = sx.astype(np.float64)[:, None, :]
    return np.stack([d[None] * sx64 * dots, m[None] * sx64 * xq.sum(-1)[:, None, :]], -1)


def assert_kernel(y: np.ndarray, x: np.ndarray, q: np.ndarray, dm: np.ndarray) -> None:
    """`y` equals the kernel's formula within float32 rounding, and the float product
    `x @ w^T` within the activations' rounding (module docstring)."""
    terms = kernel_terms(x, q, dm)
    ref = terms.sum((-1, -2))
    blocks = x.shape[1] // BLOCK
    assert y.shape == ref.shape and y.dtype == np.float32
    bound = 4 * (blocks + 16) * EPS * np.abs(terms).sum((-1, -2))
    assert np.all(np.abs(y - ref) <= bound + 1e-30), float((np.abs(y - ref) - bound).max())
    w = dequantize4(q, dm).astype(np.float64)  # [N, K]
    sx = np.abs(x.reshape(x.shape[0], -1, BLOCK)).max(-1) / 127
    act = np.einsum("mb,nb->mn", sx / 2, np.abs(w).reshape(w.shape[0], -1, BLOCK).sum(-1))
    exact = x.astype(np.float64) @ w.T
    assert np.all(np.abs(y - exact) <= act * (1 + 1e-5) + bound)


@kernel
@pytest.mark.parametrize("m", [1, 3, 5, 17])
def test_kernel_matches_its_formula(m: int) -> None:
    """K = 96: three blocks, one group padded; N = 37 rows of q: blocks of 4 and a tail."""
    x, q, dm = operands(m, 96, 37)
    assert_kernel(np.asarray(jax.jit(int4_matmul.int4_matmul)(x, q, dm)), x, q, dm)


@kernel
def test_kernel_wide_rows() -> None:
    """K = 608 (19 blocks: four groups and three left), N over several thread blocks."""
    x, q, dm = operands(2, 608, 1000, seed=1)
    assert_kernel(np.asarray(jax.jit(int4_matmul.int4_matmul)(x, q, dm)), x, q, dm)


@kernel
def test_a_row_gives_the_same_bits_in_any_number_of_rows() -> None:
    """Rows are taken in passes of 4, each quantized on its own: a row's result is the same
    bits whatever the call's row count."""
    x, q, dm = operands(13, 576, 200, seed=2)
    run = jax.jit(int4_matmul.int4_matmul)
    full = np.asarray(run(x, q, dm))
    for m in (1, 4, 5, 6, 9):
        np.testing.assert_array_equal(np.asarray(run(x[:m], q, dm)), full[:m])


# ---- the products of models/layers.py -------------------------------------------------------
SPECS = {  # qeinsum spec -> (x shape, float w shape, input axes of w)
    "bte,ehd->bthd": ((1, 3, 64), (64, 2, 5), (0,)),
    "bthd,hde->bte": ((1, 3, 2, 32), (2, 32, 7), (0, 1)),
}


def uses_kernel(fn, *args) -> bool:
    """Whether the lowered `fn(*args)` calls the int4 kernel."""
    return int4_matmul.TARGET in jax.jit(fn).lower(*args).as_text()


@pytest.mark.parametrize("spec", list(SPECS))
def test_qeinsum_takes_int4_weights(spec: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """An [in, out] einsum on an int4 weight: the kernel for few rows, XLA's dot on the
    dequantized weight above `KERNEL_MAX_ROWS_INT4` rows (and with the kernel off), which equals
    the float einsum of the dequantized weight within float32 rounding."""
    xs, ws, in_axes = SPECS[spec]
    rng = np.random.default_rng(3)
    q, dm = quantize4(rng.standard_normal(ws).astype(np.float32), in_axes)
    n_in = len(in_axes)
    deq = dequantize4(q, dm).astype(np.float64)  # [out..., K]
    for T in (xs[1], KERNEL_MAX_ROWS_INT4 + 1):
        x = rng.standard_normal((1, T, *xs[2:])).astype(np.float32)
        fn = jax.jit(lambda a, b, c, spec=spec: qeinsum(spec, a, b, c))
        kernel_rows = T <= KERNEL_MAX_ROWS_INT4 and int4_matmul.available()
        assert uses_kernel(fn, x, q, dm) == kernel_rows
        y = np.asarray(fn(x, q, dm))
        xf = x.reshape(*x.shape[:x.ndim - n_in], -1).astype(np.float64)
        ref = np.einsum("...k,...nk->...n", xf, deq.reshape(-1, deq.shape[-1])[None, None])
        ref = ref.reshape(y.shape)
        if T > KERNEL_MAX_ROWS_INT4:
            absum = np.abs(xf) @ np.abs(deq.reshape(-1, deq.shape[-1])).T
            assert np.all(np.abs(y - ref) <= 2 * xf.shape[-1] * EPS * absum.reshape(y.shape))
        else:  # the kernel: within the activations' rounding (checked with its formula above)
            assert np.abs(y - ref).max() <= 0.02 * np.abs(ref).max()
    monkeypatch.setenv("METRALE_INT4_KERNEL", "0")
    x = rng.standard_normal(xs).astype(np.float32)
    assert not uses_kernel(lambda a, b, c: qeinsum(spec, a, b, c), x, q, dm)


def test_qmatmul_takes_an_int4_weight():
    """`qmatmul(x [..., K], q [N, K / 2], dm)`: o_proj's flattened form in `project_out`."""
    rng = np.random.default_rng(4)
    q, dm = quantize4(rng.standard_normal((64, 9)).astype(np.float32), (0,))
    x = rng.standard_normal((2, 1, 64)).astype(np.float32)
    y = np.asarray(jax.jit(qmatmul)(x, q, dm))
    ref = x.astype(np.float64) @ dequantize4(q, dm).T.astype(np.float64)
    assert y.shape == (2, 1, 9)
    assert np.abs(y - ref).max() <= 0.02 * np.abs(ref).max()


# ---- a model ------------------------------------------------------------------------------
def dequantized(params: nnx.State, qparams: nnx.State) -> dict:
    """The float params (a pure dict of the float model `params`) that the int4 model
    `qparams` holds: its int4 blocks and int8 embedding / head dequantized."""
    from metrale_jax.models.quant import dequantize, stacked_in_axes

    def walk(want: dict, have: dict, path: tuple[str, ...]) -> dict:
        out = {}
        for key, leaf in want.items():
            value = have[key]
            if isinstance(leaf, dict):
                out[key] = walk(leaf, value, (*path, key))
            elif value.dtype == jnp.int8:
                out[key] = jnp.asarray(dequantize(np.asarray(value),
                                                  np.asarray(have[key + SCALE_SUFFIX]),
                                                  stacked_in_axes((*path, key))))
            elif value.dtype == jnp.uint8:  # [L, out..., K / 2] -> [L, in..., out...]
                w = dequantize4(np.asarray(value), np.asarray(have[key + SCALE_SUFFIX]))
                n_out = value.ndim - 2
                w = w.reshape(*w.shape[:-1], *leaf.shape[1:leaf.ndim - n_out])
                order = (0, *range(1 + n_out, w.ndim), *range(1, 1 + n_out))
                out[key] = jnp.asarray(np.transpose(w, order))
            else:
                out[key] = value
        return out
    return walk(nnx.to_pure_dict(params), nnx.to_pure_dict(qparams), ())


@pytest.mark.parametrize("arch", ["llama", "gemma2", "gemma3"])
def test_logits_within_the_quantization_bounds(arch, monkeypatch: pytest.MonkeyPatch):
    """llama (untied int8 head) and gemma2 (tied, soft caps, sliding windows)."""
    cfg, graphdef, params = random_model(arch)
    qcfg, qgraph, qparams = quantize_state(cfg, params, "int4")
    assert qcfg.quantization == "int4"
    pure = nnx.to_pure_dict(qparams)
    assert pure["blocks"]["attn"]["o_proj"].shape == (cfg.num_layers, cfg.hidden_size,
                                                      cfg.num_heads * cfg.head_dim // 2)
    assert pure["embed"].dtype == jnp.int8
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, cfg.vocab_size, (1, TOKENS)),
                         jnp.int32)

    def run(g, p):  # traced anew each time (the kernel switch is read while tracing)
        jax.clear_caches()
        return stacked_logits(g, p, tokens)

    ref = run(graphdef, params)
    got = run(qgraph, qparams)  # the kernel on a CPU (12 rows)
    deq = jax.tree.map(lambda x: x, params)
    nnx.replace_by_pure_dict(deq, dequantized(params, qparams))
    same = run(graphdef, deq)
    monkeypatch.setenv("METRALE_INT4_KERNEL", "0")
    xla = run(qgraph, qparams)  # traced anew: XLA's form
    scale = np.abs(ref).max()
    assert np.abs(xla - same).max() <= 1e-5 * scale
    products = 4 * cfg.num_layers
    kernel_rel = np.abs(got - xla).max() / scale
    rel = np.abs(got - ref).max() / scale
    print(arch, "int4 max rel logit error", rel, "kernel vs XLA", kernel_rel)
    assert kernel_rel <= products / 254
    assert rel <= products / 15 + (products + 1) / 254


def test_a_model_whose_inputs_do_not_split_into_blocks_is_refused():
    """A linear layer's inputs must divide by 32: the config says so, naming the size (the
    CLI turns it into exit 2)."""
    import dataclasses

    from metrale_jax.errors import InvalidParameterError
    cfg, _, _ = random_model("llama")
    with pytest.raises(InvalidParameterError, match="multiple of 32.*48"):
        dataclasses.replace(cfg, hidden_size=48, quantization="int4")
    with pytest.raises(InvalidParameterError, match="multiple of 32.*80"):
        dataclasses.replace(cfg, num_heads=5, num_kv_heads=1,  # o_proj: 5 x 16 inputs
                            quantization="int4")
