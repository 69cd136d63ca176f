"""EngineConfig validation and derived shapes."""

from __future__ import annotations

import pytest

from metrale_jax.engine import EngineConfig
from metrale_jax.errors import InvalidParameterError


def test_buckets_and_batches():
    cfg = EngineConfig(max_slots=8, min_prefill_bucket=16, max_prefill_len=128,
                       max_prefill_batch=4, compilation_cache_dir=None)
    assert cfg.prefill_buckets == (16, 32, 64, 128)
    assert cfg.prefill_batch_sizes == (1, 2, 4)
    assert cfg.bucket_for(17) == 32 and cfg.batch_size_for(3) == 4


@pytest.mark.parametrize("field,value", [
    ("max_slots", 0), ("max_len", -1), ("max_prefill_len", 100), ("min_prefill_bucket", 3),
    ("max_prefill_len", 4096), ("max_prefill_batch", 16), ("decode_steps", 0),
    ("dtype", "float16"), ("cache_dtype", "int4"), ("num_top_logprobs", 0),
])
def test_invalid_fields_are_named(field, value):
    with pytest.raises(InvalidParameterError) as err:
        EngineConfig(**{field: value})
    assert err.value.param == field and field in err.value.message


def test_prefill_defaults_fit_small_shapes():
    """Unset prefill sizes follow max_len and max_slots instead of failing validation."""
    small = EngineConfig(max_slots=1, max_len=100, compilation_cache_dir=None)
    assert small.max_prefill_len == 64 and small.max_prefill_batch == 1
    assert small.prefill_buckets == (16, 32, 64)
    tiny = EngineConfig(max_len=8, compilation_cache_dir=None)
    assert tiny.prefill_buckets == (8,)
    default = EngineConfig(compilation_cache_dir=None)
    assert default.max_prefill_len == 512 and default.max_prefill_batch == 4


def test_only_short_buckets_are_batched_and_slot_buckets():
    cfg = EngineConfig(max_slots=16, max_len=1024, compilation_cache_dir=None)
    assert cfg.prefill_batch_sizes_for(64) == (1, 2, 4)
    assert cfg.prefill_batch_sizes_for(128) == (1,)
    assert cfg.active_slot_buckets == (1, 2, 4, 8, 16)
    assert cfg.rows_for(1) == 1 and cfg.rows_for(5) == 8 and cfg.rows_for(16) == 16
