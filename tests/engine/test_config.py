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
    ("dtype", "float16"), ("cache_dtype", "int8"), ("num_top_logprobs", 0),
])
def test_invalid_fields_are_named(field, value):
    with pytest.raises(InvalidParameterError) as err:
        EngineConfig(**{field: value})
    assert err.value.param == field and field in err.value.message
