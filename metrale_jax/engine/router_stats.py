"""Router statistics of a mixture-of-experts model: the tokens each layer routed to each
expert, summed over the engine's steps, so an operator sees imbalance (`/metrics`,
`/v1/metrale/stats`).

Each step program of a MoE model returns its counts `[L, X] int32` (real tokens only:
padding and idle rows are not counted; each token counts once per each of its k experts,
`models/moe.py`). They stay on the device until read: `add` keeps the step's array and folds
the older ones into the host total (by then long computed, so the loop never waits on the
step it just launched); `totals` folds everything (any thread).
"""

from __future__ import annotations

import threading

import jax
import numpy as np

PENDING = 32
"""Steps' counts kept on the device before the older half is folded into the host total."""


class RouterStats:
    """Tokens per layer and expert, `[L, X]` int64 on the host, since the engine started."""

    def __init__(self, num_layers: int, num_experts: int):
        self._total = np.zeros((num_layers, num_experts), np.int64)
        self._pending: list[jax.Array] = []
        self._lock = threading.Lock()

    def add(self, counts: jax.Array) -> None:
        """Adds one step's counts `[L, X] int32` (a device array, not waited on)."""
        with self._lock:
            self._pending.append(counts)
            if len(self._pending) > PENDING:
                self._fold(PENDING // 2)

    def _fold(self, n: int) -> None:
        for counts in self._pending[:n]:
            self._total += np.asarray(counts, np.int64)
        del self._pending[:n]

    def totals(self) -> np.ndarray:
        """The tokens routed to each expert of each layer so far, `[L, X]` int64 (a copy)."""
        with self._lock:
            self._fold(len(self._pending))
            return self._total.copy()


__all__ = ["PENDING", "RouterStats"]
