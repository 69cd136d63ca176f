"""The step budget of a long prompt's later pieces (`engine/step_cost.py`)."""

from __future__ import annotations

import dataclasses

import pytest

from metrale_jax.config import ModelConfig
from metrale_jax.engine.step_cost import StepCost

SMOL = ModelConfig("llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                   num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64)
BUCKETS = (16, 64, 256, 512)


def test_a_fresh_chunk_and_one_chunk_of_context_fill_the_largest_bucket():
    cost = StepCost(SMOL, BUCKETS)
    assert cost.chunk_limit(0) == 512
    assert cost.chunk_limit(512) == 512
    assert cost.budget == pytest.approx(cost.piece_flops(512, 512))


def test_the_limit_falls_as_the_context_grows_and_stays_within_budget():
    cost = StepCost(SMOL, BUCKETS)
    contexts = range(0, 100_000, 250)
    limits = [cost.chunk_limit(ctx) for ctx in contexts]
    assert limits == sorted(limits, reverse=True)
    assert set(limits) == set(BUCKETS)
    for ctx in contexts:
        c = cost.chunk_limit(ctx)
        assert c == 16 or cost.piece_flops(c, ctx) <= cost.budget
        bigger = [b for b in BUCKETS if b > c]
        assert not bigger or cost.piece_flops(bigger[0], ctx) > cost.budget


def test_the_default_model_at_7500_positions():
    """A 512-token piece after 7,500 positions costs 2.8x the budget in FLOPs (and 8 s per
    step on 2 cores, where attention runs below the matmuls' efficiency); 64 tokens fit."""
    cost = StepCost(SMOL, BUCKETS)
    assert cost.piece_flops(512, 7500) / cost.budget == pytest.approx(2.82, abs=0.01)
    assert cost.chunk_limit(7500) == 64


def test_sliding_layers_read_at_most_their_window():
    """Layers that all slide within 256 positions cost the same at any context: no cut."""
    sliding = dataclasses.replace(SMOL, sliding_window=256, sliding_layers=(True,) * 30)
    cost = StepCost(sliding, BUCKETS)
    assert cost.piece_flops(512, 100_000) == cost.piece_flops(512, 256)
    assert cost.chunk_limit(100_000) == 512
    half = dataclasses.replace(SMOL, sliding_window=256, sliding_layers=(True, False) * 15)
    assert StepCost(half, BUCKETS).chunk_limit(100_000) < 512
