"""The encoder programs' grid and batch planning (pure host code, nothing compiles)."""

from __future__ import annotations

import pytest

from metrale_jax.embedding.encoder_buckets import bucket_grid, powers_of_two


def test_powers_of_two_end_at_the_limit():
    assert powers_of_two(16, 256) == [16, 32, 64, 128, 256]
    assert powers_of_two(16, 300) == [16, 32, 64, 128, 256, 300]
    assert powers_of_two(16, 10) == [10]
    assert powers_of_two(1, 8) == [1, 2, 4, 8]


def test_grid_keeps_rows_times_length_within_the_budget():
    grid = bucket_grid(256, max_rows=256, token_budget=8192)
    shapes = grid.shapes()
    assert all(r * s <= 8192 for r, s in shapes)
    assert (256, 32) in shapes and (32, 256) in shapes and (64, 256) not in shapes
    assert {s for _, s in shapes} == {16, 32, 64, 128, 256}
    # a single row of the longest length is allowed even past a small budget
    assert bucket_grid(512, max_rows=8, token_budget=64).rows_for(512) == (1,)


@pytest.mark.parametrize("lengths", [[5], [3, 30, 17, 2, 2, 16, 31, 1, 9],
                                     [32] * 7 + [1] * 5, list(range(1, 33)) * 3])
def test_plan_covers_every_input_once_in_a_bucket_that_holds_it(lengths):
    grid = bucket_grid(32, max_rows=4, token_budget=64)
    batches = grid.plan(lengths)
    seen = sorted(i for _, _, indices in batches for i in indices)
    assert seen == list(range(len(lengths)))
    for R, S, indices in batches:
        assert (R, S) in grid.shapes()
        assert 1 <= len(indices) <= R
        assert all(lengths[i] <= S for i in indices)


def test_plan_fills_a_row_bucket_with_shorter_inputs():
    grid = bucket_grid(32, max_rows=4, token_budget=128)
    # three long inputs take a 4-row bucket of 32; its free row takes the longest short one
    batches = grid.plan([30, 31, 29, 3, 4])
    assert batches[0][:2] == (4, 32) and sorted(batches[0][2]) == [0, 1, 2, 4]
    assert batches[1] == (1, 16, [3])


def test_plan_rounds_rows_down_when_few_inputs_would_fill_the_bucket():
    grid = bucket_grid(32, max_rows=8, token_budget=256)
    # five long inputs: a batch of 4 and one of 1, not 8 rows of 32 with 3 short ones padded
    batches = grid.plan([30] * 5 + [3] * 3)
    assert [(R, S, len(i)) for R, S, i in batches] == [(4, 32, 4), (1, 32, 1), (4, 16, 3)]
    batches = grid.plan([30] * 5 + [3] * 8)
    assert [(R, S, len(i)) for R, S, i in batches] == [(4, 32, 4), (1, 32, 1), (8, 16, 8)]


def test_plan_refuses_an_input_longer_than_the_largest_bucket():
    with pytest.raises(ValueError, match="longer than the largest bucket"):
        bucket_grid(32).plan([33])
