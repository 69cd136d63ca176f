"""Prompt pieces on the host: cutting, planning one step's pieces, the prompt check (no device)."""

from __future__ import annotations

import collections

import pytest

from metrale_jax.engine import Piece, SlotSettings, plan_pieces
from metrale_jax.engine.pieces import check_prompt
from metrale_jax.errors import ContextLengthError, InvalidParameterError


def test_cut_puts_the_settings_on_the_last_piece():
    settings = SlotSettings()
    pieces = Piece.cut(3, range(10), settings, 4)
    assert [(p.start, p.tokens) for p in pieces] == [(0, (0, 1, 2, 3)), (4, (4, 5, 6, 7)),
                                                     (8, (8, 9))]
    assert [p.settings for p in pieces] == [None, None, settings]
    assert all(p.slot == 3 for p in pieces)


def test_plan_takes_one_piece_per_row_within_the_budgets():
    settings = SlotSettings()
    work = collections.deque(
        [(0, p) for p in Piece.cut(0, range(6), settings, 4)]
        + [(1, p) for p in Piece.cut(1, range(3), settings, 4)]
        + [(2, p) for p in Piece.cut(2, range(2), settings, 4)])
    batch, cols = plan_pieces(work, budget=8, finish_limit=2)
    # row 0's second piece waits for the next step: one piece per row
    assert [(p.slot, p.start) for p in batch] == [(0, 0)] and cols == []
    batch, cols = plan_pieces(work, budget=8, finish_limit=1)
    # row 0's last piece and row 1's finish; the finish limit stops at one
    assert [(p.slot, p.start) for p in batch] == [(0, 4)] and cols == [0]
    batch, cols = plan_pieces(work, budget=4, finish_limit=2)
    assert [p.slot for p in batch] == [1] and cols == [1]  # the token budget stops row 2
    batch, cols = plan_pieces(work, budget=4, finish_limit=2)
    assert [p.slot for p in batch] == [2] and cols == [2] and not work


def test_check_prompt_keeps_a_position_for_the_first_token():
    check_prompt(127, 128)
    with pytest.raises(ContextLengthError, match="at most 127 prompt tokens"):
        check_prompt(128, 128)
    with pytest.raises(InvalidParameterError, match="empty"):
        check_prompt(0, 128)
