"""How much a prompt piece costs a ragged step, so that no step grows past its budget.

A step's chunk of C prompt tokens costs, per layer, the projections and MLP of C tokens
(about `2 (E (H + 2K) D + H D E + 3 E F)` FLOPs each) plus attention: each token reads the
positions before it, `4 H D` FLOPs per position (scores and the weighted sum). A fresh prompt's
chunk attends within itself (C / 2 positions per token on average); a long prompt's later
piece also attends to its `ctx` positions already in the pages, which grows the step without
bound: on a 2-core CPU a 512-token piece with 7,500 positions of context took 8 s, against
under 1 s at the start of the prompt, and every decoding row waited for it.

`StepCost.budget` is the cost of a full chunk (`max_prefill_len` tokens) that continues after
one chunk of context; `chunk_limit(ctx)` is the largest chunk bucket whose cost, for a piece
continuing after `ctx` positions, stays within it, and `piece_limit` cuts each piece of a step
so that all of them together stay within it (pieces after a long shared prefix included). A
later piece of a long prompt then shrinks as its context grows (the scheduler fills the rest of
the chunk with the prompts behind it, which read only their own context: `chunk_attention`),
and the rows that decode beside it keep their pace.
This cap applies only while rows decode (`scheduler/chunks.py`); the latency target
(`scheduler/step_time.py`) then sizes each step's chunk by its predicted time as well.
Prefill throughput does not suffer where the cut applies: attention, linear in the piece's
size, dominates each token's cost there. Sliding-window layers (Mistral, Gemma 2) read at most
`sliding_window` positions.
"""

from __future__ import annotations

from metrale_jax.config import ModelConfig


class StepCost:
    """The FLOP model of a prompt piece (see the module docstring).

    Args:
        cfg: the architecture (widths, heads, layers, sliding windows).
        chunk_buckets: the engine's chunk sizes C, ascending (`EngineConfig.chunk_buckets`).
    """

    def __init__(self, cfg: ModelConfig, chunk_buckets: tuple[int, ...]):
        E, H, K, D, F = (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                         cfg.intermediate_size)
        self.token_flops = 2.0 * (E * (H + 2 * K) * D + H * D * E + 3 * E * F)
        self.position_flops = 4.0 * H * D
        self.windows = tuple(cfg.sliding_window if sliding else None
                             for sliding in cfg.layer_is_sliding)
        self.buckets = tuple(chunk_buckets)
        top = self.buckets[-1]
        self.budget = self.piece_flops(top, top)

    def piece_flops(self, size: int, ctx: int) -> float:
        """FLOPs of the layers for a piece of `size` tokens after `ctx` positions of context."""
        total = 0.0
        for window in self.windows:
            read = ctx + size / 2  # positions each token reads, on average
            if window is not None:
                read = min(read, window)
            total += size * (self.token_flops + read * self.position_flops)
        return total

    def context_flops(self, size: int, ctx: int) -> float:
        """FLOPs of a piece of `size` tokens' attention to the `ctx` positions before it (what
        `piece_flops` adds over the same piece at the start of a prompt)."""
        return self.piece_flops(size, ctx) - self.piece_flops(size, 0) if ctx else 0.0

    def piece_limit(self, remaining: int, ctx: int, flops_left: float) -> int:
        """The tokens a piece may take of the `remaining` ones of its prompt, after `ctx`
        positions of context, within `flops_left`: all of them when they fit, else the
        largest chunk bucket that fits, else 0."""
        if self.piece_flops(remaining, ctx) <= flops_left:
            return remaining
        fits = [c for c in self.buckets
                if c < remaining and self.piece_flops(c, ctx) <= flops_left]
        return fits[-1] if fits else 0

    def chunk_limit(self, ctx: int) -> int:
        """The largest chunk bucket a piece continuing after `ctx` positions may fill (never
        below the smallest bucket)."""
        fits = [c for c in self.buckets if self.piece_flops(c, ctx) <= self.budget]
        return fits[-1] if fits else self.buckets[0]
