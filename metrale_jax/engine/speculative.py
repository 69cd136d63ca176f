"""Speculative decoding's verify step: each row's last token plus its draft tokens in one forward.

Row b (of rows 0 .. n-1) feeds `k_b + 1` tokens: its last sampled token and its `k_b <= k`
draft tokens `d_1 .. d_k_b` (host proposed, `scheduler/ngram_draft.py`), at positions
`p_b .. p_b + k_b`, as one piece of a prefill chunk (`models/ragged.py`: every token's key
and value are written into the row's pages, each token attends to its row's context and the
piece's earlier tokens). At each of the `k_b + 1` positions j the row's next token y_j is
sampled exactly as a decode step would sample it there: the same processors (the history
holding `d_1 .. d_j`), the same key `fold_in(keys[b], steps[b] + j)`.

Acceptance: d_{j+1} is accepted when y_j == d_{j+1}. With the Gumbel-max draw, y_j is a sample
of the target distribution p_j, so a draft token is accepted with probability p_j(d_{j+1})
and, when rejected, y_j is distributed as p_j with d_{j+1} removed and renormalised: the
standard speculative rule for a deterministic (point-mass) draft, and the emitted tokens
`y_0 .. y_a` (a = accepted drafts; y_a the correction or, all accepted, the bonus token) are
the very tokens non-speculative decoding would sample with the same seed. Greedy is exactly
greedy, and a seeded request gives the same tokens with or without speculation, alone or in
any batch. The row advances by a + 1; the keys and values written for rejected drafts lie
past its new length, never read, and overwritten by the tokens that follow.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from metrale_jax.engine.sampling import sample
from metrale_jax.engine.sampling_state import TokenHistory
from metrale_jax.engine.state import DecodeState, StepOutput
from metrale_jax.engine.steps import SampleConfig, head, pad_columns, slot_of, with_window
from metrale_jax.models.paged_attention import decode_kernel_applies, use_tpu_kernel
from metrale_jax.models.ragged import StepLayout, kernel_layout, ragged_layers
from metrale_jax.models.scanned import pool_page_size


@dataclasses.dataclass(frozen=True)
class VerifyShape:
    """The static shape of one verify step: rows 0 .. n-1 (an active-slot bucket), each with
    room for k draft tokens (the engine's `speculative_tokens`)."""

    n: int
    k: int


def verify_step(graph, sc: SampleConfig, shape: VerifyShape, params, state: DecodeState,
                page_table: jax.Array, active: jax.Array, allowed: jax.Array,
                drafts: jax.Array, draft_lens: jax.Array, lora: tuple | None = None,
                lora_mix: jax.Array | None = None
                ) -> tuple[DecodeState, StepOutput, jax.Array]:
    """One verify step (state donated).

    page_table: [B, PPS] int32 (covering positions p_b .. p_b + k_b of every active row);
    active: [B] bool, the rows that advance; allowed: [B, W] uint32 grammar bitmasks for
    position 0 (rows with a grammar draft nothing); drafts: [n, k] int32; draft_lens: [n]
    int32, how many of a row's drafts are real (0: the row decodes one token, as in a decode
    step); lora, lora_mix: as `steps.ragged_step`. Returns the state, StepOutput `[k + 1, B]`
    (column b: y_0 .. y_k of row b, their logprobs and top lists) and emitted: [B] int32, how
    many of them row b emits (a + 1; 0 for inactive rows).
    """
    B, pps = state.tokens.shape[0], page_table.shape[1]
    page_size = pool_page_size(state.pages)
    cap = pps * page_size
    n, k = shape.n, shape.k
    K1 = k + 1
    live = active[:n]
    pos0 = state.positions[:n]
    # Drafts never reach past the row's last position.
    lens = jnp.where(live, jnp.clip(draft_lens, 0, jnp.maximum(cap - 1 - pos0, 0)), 0)
    lens = jnp.minimum(lens, k)
    j = jnp.arange(K1, dtype=jnp.int32)
    inputs = jnp.concatenate([state.tokens[:n, None], drafts.astype(jnp.int32)], axis=1)
    pos = pos0[:, None] + j[None, :]  # [n, K1]
    real = live[:, None] & (j[None, :] <= lens[:, None])
    row_ids = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32)[:, None], (n, K1))
    # The chunk: the real tokens first, row by row (padding after them, as the chunk wants).
    flat_real = real.reshape(-1)
    order = jnp.argsort(~flat_real, stable=True)
    tok_c = inputs.reshape(-1)[order]
    pos_c = pos.reshape(-1)[order]
    real_c = flat_real[order]
    rows_c = jnp.where(real_c, row_ids.reshape(-1)[order], -1)
    safe_rows = jnp.clip(rows_c, 0, B - 1)
    slots = slot_of(page_table[safe_rows], pos_c, real_c, page_size)
    compute = params.outer["final_norm"]["weight"][...].dtype  # the queries' dtype
    if decode_kernel_applies(compute, jax.tree.leaves(state.pages)[0].dtype):
        # Where decode attention is the CPU kernel, each verify token is a decode row of its
        # own (its row's pages, its position + 1 visible; the row's earlier tokens of this
        # step are written before attention): the arithmetic decoding gives that position.
        n_dec = n * K1
        layout = StepLayout(slots=slots, dec_table=page_table[safe_rows],
                            dec_lens=jnp.where(real_c, pos_c + 1, 0),
                            chunk_rows=jnp.zeros((0,), jnp.int32), page_table=page_table)
    else:
        n_dec = 0
        kernel = kernel_layout(page_table, jnp.zeros((0,), jnp.int32), rows_c, pos_c) \
            if use_tpu_kernel() else None
        layout = StepLayout(slots=slots, dec_table=page_table[:0],
                            dec_lens=jnp.zeros((0,), jnp.int32), chunk_rows=rows_c,
                            page_table=page_table, kernel=kernel)
    layout = with_window(layout, state.pages, safe_rows if n_dec else safe_rows[:0], rows_c,
                         pos_c)
    mix = None
    if lora is not None:
        mix = jnp.where(real_c[:, None], lora_mix[safe_rows], 0.0)
    x, pages = ragged_layers(graph, params, state.pages, tok_c, pos_c, layout, n=n_dec,
                             lora=lora, lora_mix=mix)
    hidden = x[jnp.argsort(order)]  # back to [n * K1] row-major: (row, position j)
    logits = head(graph, params, hidden)

    # Each position's history: the row's, with the inputs up to it appended.
    h = state.history
    S, V = h.tokens.shape[1], h.counts.shape[1]
    put = jnp.where(real, pos, S)
    row_tokens = h.tokens[:n].at[jnp.arange(n)[:, None], put].set(inputs, mode="drop")
    onehot = jnp.zeros((n, K1, V), jnp.int32).at[
        jnp.arange(n)[:, None], j[None, :], inputs].add(1)
    counts = h.counts[:n, None, :] + jnp.cumsum(onehot, axis=1)  # [n, K1, V]
    rep = functools.partial(jnp.repeat, repeats=K1, axis=0)
    pos_history = TokenHistory(rep(row_tokens), counts.reshape(n * K1, V),
                               rep(h.prompt_seen[:n]))
    sampling = jax.tree.map(lambda a: rep(a[:n]), state.sampling)
    steps0 = state.steps[:n]
    all_ones = jnp.full(allowed.shape[1:], 0xFFFFFFFF, allowed.dtype)
    pos_allowed = jnp.where((j == 0)[None, :, None], allowed[:n, None, :],
                            all_ones[None, None, :]).reshape(n * K1, -1)
    res = sample(logits, sampling, pos_history, (pos + 1).reshape(-1),
                 (steps0[:, None] + j[None, :]).reshape(-1), sc.num_top, sc.logprobs_mode,
                 pos_allowed)
    y = res.tokens.reshape(n, K1)
    match = (y[:, :k] == inputs[:, 1:]) & (j[None, :k] < lens[:, None])
    acc = jnp.sum(jnp.cumprod(match.astype(jnp.int32), axis=1), axis=1)  # [n]
    emitted = jnp.where(live, acc + 1, 0)

    # The row advances by acc + 1: inputs 0 .. acc join its history, y_acc is its next input.
    keep = real & (j[None, :] <= acc[:, None])
    kept_tokens = h.tokens[:n].at[jnp.arange(n)[:, None], jnp.where(keep, pos, S)].set(
        inputs, mode="drop")
    kept_counts = jnp.take_along_axis(counts, acc[:, None, None], axis=1)[:, 0]
    kept_counts = jnp.where(live[:, None], kept_counts, h.counts[:n])
    history = TokenHistory(h.tokens.at[:n].set(kept_tokens), h.counts.at[:n].set(kept_counts),
                           h.prompt_seen)
    last = jnp.take_along_axis(y, acc[:, None], axis=1)[:, 0]
    new = dataclasses.replace(
        state, pages=pages,
        positions=state.positions.at[:n].set(
            jnp.where(live, jnp.minimum(pos0 + acc + 1, cap), pos0)),
        tokens=state.tokens.at[:n].set(jnp.where(live, last, state.tokens[:n])),
        steps=state.steps.at[:n].set(steps0 + emitted), history=history)
    N = res.top_ids.shape[-1]
    out = StepOutput(y.T, res.logprobs.reshape(n, K1).T,
                     res.top_ids.reshape(n, K1, N).transpose(1, 0, 2),
                     res.top_logprobs.reshape(n, K1, N).transpose(1, 0, 2))
    return new, pad_columns(out, B), jnp.pad(emitted, (0, B - n))


__all__ = ["VerifyShape", "verify_step"]
