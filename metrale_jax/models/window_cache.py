"""The sliding-window layers' own KV cache: a ring of W pages per row (a hybrid KV cache).

A sliding-window layer (Gemma 2 and 3, with global layers between) attends only to the last
`sliding_window` positions, so its cache need not grow with the context. With the window cache
(`EngineConfig.sliding_cache`, "window") its pool holds, for each row b, the W pages
`1 + b*W .. (b+1)*W` (page 0 is the null page), and position p of row b lives in ring page
`1 + b*W + (p // ps) % W`: a page behind the window is written over by the positions that
come after it. The global layers keep the shared paged pool and its page table
(`engine/pages.py`), which the prefix cache indexes.

W is the smallest ring that never overwrites a position a step still reads: a step's queries
of one row at positions `p .. p + n - 1` (n at most the largest chunk, decode steps or
verified drafts) read from `p - window + 1` and write up to `p + n - 1`, a span of
`window - 1 + n` positions: W = ceil((window - 1 + n) / ps) + 1 pages (one more for a span
that does not start on a page boundary). Every page table the attention reads for these layers
is the ring seen as a `[B, PPS]` table (`window_table`): column j of row b is its ring page
`j % W`, so the attention code indexes positions as it does for the paged pool; columns behind
the window alias newer pages, which the window's mask hides.

The pools of a model with a window cache are `WindowedPools`: the global layers' pools (`full`)
and the sliding layers' (`window`), each in the layer loop's form (a tuple of pools, unrolled;
one stacked array, scanned; `models/scanned.py`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class WindowedPools:
    """The KV pools of a model whose sliding-window layers keep a ring per row.

    full: the global layers' pools, in model order: a tuple of `[N, ps, 2K, D]` (unrolled) or
    one `[Lg, N, ps, 2K, D]` (scanned); window: the sliding layers', `[B*W + 1, ps, 2K, D]`
    each, in the same form (`[Ls, B*W + 1, ...]` scanned)."""

    full: tuple[jax.Array, ...] | jax.Array
    window: tuple[jax.Array, ...] | jax.Array


def window_columns(window: int, longest_write: int, page_size: int) -> int:
    """W, the ring pages per row for a `window` and at most `longest_write` positions of one
    row written in one step (see the module docstring)."""
    return -(-(window - 1 + longest_write) // page_size) + 1


def ring_columns(pages: WindowedPools, slots: int) -> int:
    """W of `pages` for `slots` rows (from the window pool's page count, `B*W + 1`)."""
    window = pages.window
    first = window if not isinstance(window, tuple | list) else window[0]
    return (first.shape[-4] - 1) // slots


def window_table(slots: int, pages_per_seq: int, columns: int) -> jax.Array:
    """The rings as a page table `[B, PPS] int32`: row b's column j is page
    `1 + b*W + j % W`."""
    b = jnp.arange(slots, dtype=jnp.int32)[:, None]
    j = jnp.arange(pages_per_seq, dtype=jnp.int32)[None, :]
    return 1 + b * columns + j % columns


def ring_slots(rows: jax.Array, positions: jax.Array, ok: jax.Array, columns: int,
               page_size: int) -> jax.Array:
    """Flat window-pool slots `[T] int32` of tokens at `positions` of `rows` (`[T] int32`
    each); where not `ok` `[T] bool`, a slot of the null page."""
    page = 1 + jnp.maximum(rows, 0) * columns + (positions // page_size) % columns
    return jnp.where(ok, page * page_size + positions % page_size, positions % page_size)


def group_pools(pools: list, sliding: tuple[bool, ...]) -> WindowedPools:
    """L per-layer pools in model order -> `WindowedPools` (tuples) by each layer's kind."""
    return WindowedPools(tuple(p for p, s in zip(pools, sliding, strict=True) if not s),
                         tuple(p for p, s in zip(pools, sliding, strict=True) if s))


def layer_pools(pages: WindowedPools, sliding: tuple[bool, ...]) -> list:
    """The unrolled form's pools in model order (each layer's from its kind's tuple)."""
    full, window = iter(pages.full), iter(pages.window)
    return [next(window) if s else next(full) for s in sliding]


__all__ = [
    "WindowedPools",
    "group_pools",
    "layer_pools",
    "ring_columns",
    "ring_slots",
    "window_columns",
    "window_table",
]
