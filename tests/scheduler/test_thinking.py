"""`ThinkingBudget`: the end-of-thinking ids are forced once the budget is spent."""

from __future__ import annotations

import pytest

from metrale_jax.scheduler.thinking import ThinkingBudget, ThinkingBudgetSpec

START, CLOSE, NL = 7, 8, 9
END = (NL, CLOSE, NL)


def run(spec: ThinkingBudgetSpec, sampled: list[int]) -> list[int]:
    """Generates: each step takes the forced id if any, else the next sampled one."""
    budget, out, it = ThinkingBudget(spec), [], iter(sampled)
    for _ in range(len(sampled) + len(spec.end_ids)):
        forced = budget.forced()
        token = forced if forced is not None else next(it, None)
        if token is None:
            break
        budget.observe(token)
        out.append(token)
    return out


def test_forces_the_end_after_the_budget():
    spec = ThinkingBudgetSpec(3, (START,), (CLOSE,), END)
    assert run(spec, [START, 1, 2, 3, 4, 5, 6]) == [START, 1, 2, 3, *END, 4, 5, 6]


def test_nothing_forced_when_the_model_closes_in_time():
    spec = ThinkingBudgetSpec(5, (START,), (CLOSE,), END)
    assert run(spec, [START, 1, CLOSE, 2, 3, 4, 5, 6, 7]) == [START, 1, CLOSE, 2, 3, 4, 5, 6, 7]


def test_open_prompt_counts_from_the_first_token_and_zero_budget():
    assert run(ThinkingBudgetSpec(2, (START,), (CLOSE,), END, open=True), [1, 2, 3]) == [
        1, 2, *END, 3]
    assert run(ThinkingBudgetSpec(0, (START,), (CLOSE,), END, open=True), [1]) == [*END, 1]


def test_no_thinking_no_forcing_and_multi_token_tags():
    spec = ThinkingBudgetSpec(1, (START, START), (CLOSE, CLOSE), (CLOSE, CLOSE))
    assert run(spec, [1, 2, 3, START]) == [1, 2, 3, START]  # one START is no opening tag
    assert run(spec, [START, START, 1, 2]) == [START, START, 1, CLOSE, CLOSE, 2]


def test_spec_checks():
    with pytest.raises(ValueError):
        ThinkingBudgetSpec(-1, (START,), (CLOSE,), END)
    with pytest.raises(ValueError):
        ThinkingBudgetSpec(1, (START,), (), END)


def test_needs_sync_only_near_the_budget():
    b = ThinkingBudget(ThinkingBudgetSpec(3, (START,), (CLOSE,), END))
    assert not b.needs_sync(1)
    for token in (START, 1):
        b.observe(token)
    assert not b.needs_sync(1)  # 1 thought + 1 in flight < 3
    b.observe(2)
    assert b.needs_sync(1) and not b.needs_sync(0)  # the in-flight one may reach the budget
    b.observe(3)
    assert b.forced() == NL and b.needs_sync(0)
    for token in END:
        b.observe(token)
    assert b.forced() is None and not b.needs_sync(5)

