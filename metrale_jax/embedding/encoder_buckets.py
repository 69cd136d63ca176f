"""The encoder programs' shape grid and how a set of inputs is cut into batches over it.

A grid is every (R rows, S positions) pair of power-of-two row buckets and length buckets
with R * S within a token budget (R = 1 always allowed), S up to the model's limit (the last
length bucket is the limit itself when it is not a power of two). A set of inputs is sorted
longest first; each batch takes the longest inputs left, in the smallest length bucket that
holds the first, up to the most rows that bucket allows: as many as a row bucket holds,
rounded up to the next row bucket (its free rows filled with the next, shorter, inputs) when
they fill most of it, else down (the rest go in the next batch), so that few short inputs
are padded to a long bucket.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

FILL_RATIO = 0.75
"""A batch rounds its rows up to the next row bucket when its inputs of that length fill at
least this share of it (the rest filled with shorter inputs), else down."""


def powers_of_two(low: int, high: int) -> list[int]:
    """Powers of two from the first >= low up to the first >= high, the last one cut to
    `high`: (16, 256) -> [16, 32, 64, 128, 256]; (16, 300) -> [16, ..., 256, 300]."""
    out, n = [], 1
    while n < low:
        n *= 2
    while n < high:
        out.append(n)
        n *= 2
    out.append(high)
    return out


@dataclasses.dataclass(frozen=True)
class BucketGrid:
    """lengths: the S buckets ascending; rows: the R buckets ascending; token_budget: the most
    R * S of a program (a single row of any length is always allowed)."""

    lengths: tuple[int, ...]
    rows: tuple[int, ...]
    token_budget: int

    def rows_for(self, length: int) -> tuple[int, ...]:
        """The row buckets allowed with length bucket `length`."""
        allowed = tuple(r for r in self.rows if r * length <= self.token_budget)
        return allowed or self.rows[:1]

    def shapes(self) -> list[tuple[int, int]]:
        """Every (R, S) program of the grid."""
        return [(r, s) for s in self.lengths for r in self.rows_for(s)]

    def length_for(self, n: int) -> int:
        """The smallest length bucket holding `n` tokens."""
        for s in self.lengths:
            if n <= s:
                return s
        raise ValueError(f"{n} tokens is longer than the largest bucket {self.lengths[-1]}")

    def plan(self, lengths: Sequence[int]) -> list[tuple[int, int, list[int]]]:
        """Batches `(R, S, indices)` covering every input of `lengths` once (indices into
        `lengths`, at most R of them, each input <= S tokens)."""
        order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
        batches, at = [], 0
        while at < len(order):
            S = self.length_for(lengths[order[at]])
            allowed = self.rows_for(S)
            same = at
            while same < len(order) and self.length_for(lengths[order[same]]) == S:
                same += 1
            n = min(same - at, allowed[-1])
            up = next(r for r in allowed if r >= n)
            down = max(r for r in allowed if r <= n)
            R = up if n >= FILL_RATIO * up else down
            take = min(R, len(order) - at)
            batches.append((R, S, order[at:at + take]))
            at += take
        return batches


def bucket_grid(max_tokens: int, max_rows: int = 256, token_budget: int = 8192,
                min_length: int = 16) -> BucketGrid:
    """The grid for inputs of up to `max_tokens` tokens: length buckets from `min_length`
    (powers of two, the last one `max_tokens`), row buckets 1, 2, 4 .. max_rows."""
    lengths = powers_of_two(min(min_length, max_tokens), max_tokens)
    return BucketGrid(tuple(lengths), tuple(powers_of_two(1, max_rows)), token_budget)


__all__ = ["BucketGrid", "bucket_grid", "powers_of_two"]
