"""The int8 KV cache (`metrale_jax/models/kv_quant.py`): the row round trip, writes into an int8
pool, decode and chunk attention over int8 pages (the C++ kernel and XLA's loop), and the
logits of every architecture through an int8 cache against a float32 one.

Tolerances come from the quantization error, not from a run:
- per element, `|x - q * s| <= s / 2` with `s = max|row| / 127`: 1/254 of the row's largest
  magnitude;
- attention over int8 pages equals attention over a float32 pool holding the dequantized rows
  up to float32 rounding (the kernel applies a row's scale after its dot product): 1e-5 of
  the output's range;
- against a float32 cache: a token's path reads 2 quantized operands per layer (its keys'
  scores and the values it mixes), each adding to first order at most 1/254 of the logits'
  scale, so `max |logits_int8 - logits_f32| <= 2 L / 254 * max |logits_f32|` (the same
  first-order argument as tests/models/test_quant.py's for int8 weights).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from metrale_jax.models import paged_attention as pa
from metrale_jax.models.kv_quant import (
    SCALE_BYTES,
    as_stored,
    dequantize_rows,
    head_dim_of,
    quantize_rows,
    stored_head_dim,
)
from tests.models.test_quant import ARCHS, random_model

N, PS, K, D, H = 32, 8, 2, 16, 6  # pages, page size, kv heads, head dim, query heads


def _rows(seed: int, shape) -> np.ndarray:
    """Rows with a spread of magnitudes (each row its own scale) and one all-zero row."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype(np.float32)
    x *= np.exp(rng.uniform(-4, 4, (*shape[:-1], 1))).astype(np.float32)
    x.reshape(-1, shape[-1])[0] = 0.0
    return x


def test_row_round_trip_within_half_a_step():
    x = _rows(0, (50, 6, 64))
    packed = np.asarray(quantize_rows(jnp.asarray(x)))
    assert packed.dtype == np.int8 and packed.shape == (50, 6, 64 + SCALE_BYTES)
    scale = np.ascontiguousarray(packed[..., 64:]).view(np.float32)[..., 0]  # the row's bytes
    # XLA may divide as a multiply by 1/127: within 2 ulp of numpy's quotient
    np.testing.assert_allclose(scale, np.abs(x).max(-1) / 127, rtol=2.4e-7)
    values = packed[..., :64].astype(np.int32)
    assert np.abs(values).max() <= 127
    assert np.all(np.abs(values).max(-1).reshape(-1)[1:] == 127)  # each row uses the range
    back = np.asarray(dequantize_rows(jnp.asarray(packed)))
    assert back.dtype == np.float32 and back.shape == x.shape
    assert np.all(np.abs(back - x) <= scale[..., None] / 2 * (1 + 1e-6) + 1e-30)
    assert np.all(back.reshape(-1, 64)[0] == 0)  # the zero row: scale 0, zeros back
    np.testing.assert_array_equal(np.asarray(as_stored(jnp.asarray(x), jnp.int8)), back)
    assert as_stored(jnp.asarray(x), jnp.float32) is not None
    np.testing.assert_array_equal(np.asarray(as_stored(jnp.asarray(x), jnp.float32)), x)


def test_layout_helpers():
    assert stored_head_dim(64, jnp.int8) == 68 and stored_head_dim(64, jnp.float32) == 64
    assert head_dim_of(jnp.zeros((2, 4, 6, 68), jnp.int8)) == 64
    assert head_dim_of(jnp.zeros((2, 4, 6, 64), jnp.bfloat16)) == 64


def test_write_kv_quantizes_each_token_head_row():
    rng = np.random.default_rng(1)
    T = 5
    k = jnp.asarray(_rows(2, (T, K, D)))
    v = jnp.asarray(rng.standard_normal((T, K, D)), jnp.float32)
    slots = jnp.asarray([9, 10, 17, 0, 0], jnp.int32)  # two padding tokens on the null page
    pool = pa.write_kv(jnp.zeros((N, PS, 2 * K, D + SCALE_BYTES), jnp.int8), k, v, slots)
    assert pool.dtype == jnp.int8
    flat = np.asarray(dequantize_rows(pool)).reshape(N * PS, 2 * K, D)
    for t in range(3):
        s = int(slots[t])
        np.testing.assert_array_equal(flat[s, 0::2], np.asarray(as_stored(k[t], jnp.int8)))
        np.testing.assert_array_equal(flat[s, 1::2], np.asarray(as_stored(v[t], jnp.int8)))
    untouched = np.ones(N * PS, bool)
    untouched[[0, 9, 10, 17]] = False
    assert np.all(flat[untouched] == 0)


def _decode_case(seed: int, n: int = 4, pps: int = 6):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((n, H, D)), jnp.float32)
    pool = quantize_rows(jnp.asarray(_rows(seed, (N, PS, 2 * K, D))))
    table = jnp.asarray(rng.permutation(np.arange(1, N))[:n * pps].reshape(n, pps), jnp.int32)
    lens = jnp.asarray([1, 17, 0, 40][:n], jnp.int32)  # one position, page edges, idle, many
    return q, pool, table, lens


@pytest.mark.parametrize("window,cap", [(None, None), (5, None), (None, 3.0)])
def test_decode_over_int8_pages_is_decode_over_their_dequantized_rows(window, cap):
    q, pool, table, lens = _decode_case(3)
    opts = dict(sm_scale=0.25, sliding_window=window, soft_cap=cap)
    ref = np.asarray(pa.decode_attention(q, dequantize_rows(pool), table, lens, **opts,
                                         kernel=False))
    xla = np.asarray(pa.decode_attention(q, pool, table, lens, **opts, kernel=False))
    kern = np.asarray(pa.decode_attention(q, pool, table, lens, **opts))
    scale = np.abs(ref).max()
    assert np.abs(xla - ref).max() <= 1e-5 * scale
    assert np.abs(kern - ref).max() <= 1e-5 * scale
    assert np.all(kern[2] == 0) and np.all(xla[2] == 0)  # the idle row


def test_int8_decode_kernel_row_same_alone_and_in_a_batch():
    from metrale_jax.kernels import decode_attention as cpu_kernel
    if not cpu_kernel.available():
        pytest.skip("the CPU decode kernel is not built here")
    q, pool, table, lens = _decode_case(4)
    run = jax.jit(lambda q, t, ln: pa.decode_attention(q, pool, t, ln, sm_scale=0.25,
                                                       sliding_window=None, soft_cap=None))
    assert "metrale_decode_attention_int8" in run.lower(q, table, lens).as_text()
    batch = np.asarray(run(q, table, lens))
    alone = np.asarray(run(q[3:], table[3:], lens[3:]))
    np.testing.assert_array_equal(batch[3:], alone)


def test_chunk_with_context_over_int8_pages():
    """A mixed step (decode rows, then a chunk whose pieces read context from the pages) over
    an int8 pool equals the same step over the dequantized float pool."""
    from tests.models.test_paged_attention import make_batch
    q, pages, kv_lens, table, cu, num_seqs = make_batch(5, [9, 30], [(7, 20), (5, 0)], 32)
    pool = quantize_rows(pages)
    opts = dict(sm_scale=0.3, num_decode=2)
    got = np.asarray(pa.ragged_paged_attention(q, pool, kv_lens, table, cu, num_seqs, **opts))
    ref = np.asarray(pa.ragged_paged_attention(q, dequantize_rows(pool), kv_lens, table, cu,
                                               num_seqs, **opts))
    real = int(cu[int(num_seqs[0])])
    assert np.abs(got[:real] - ref[:real]).max() <= 1e-5 * np.abs(ref[:real]).max()


# ---- logits per architecture, through the paged path ----------------------------------------
@pytest.mark.parametrize("arch", list(ARCHS))
def test_logits_through_an_int8_cache_within_the_quantization_bound(arch):
    from metrale_jax.models.ragged import sequence_logits
    from metrale_jax.models.unrolled import split_layers
    cfg, graphdef, params = random_model(arch)
    graph, layers = split_layers(graphdef, params)
    ids = np.random.default_rng(6).integers(0, cfg.vocab_size, 40).tolist()
    # chunks of 16: the later chunks read earlier context back from the (int8) pages
    ref = np.asarray(sequence_logits(graph, layers, ids, page_size=8, chunk=16))
    got = np.asarray(sequence_logits(graph, layers, ids, page_size=8, chunk=16,
                                     cache_dtype=jnp.int8))
    rel = np.abs(got - ref).max() / np.abs(ref).max()
    bound = 2 * cfg.num_layers / 254
    print(arch, "max rel logit error, int8 KV", rel, "bound", bound)
    assert rel <= bound, (rel, bound)
