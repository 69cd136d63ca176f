"""The pure functions the engine compiles: the ragged step (decode rows + prefill chunk) and init.

Each takes params and state as arguments (never closed over); the static parts (the model's
`LayerGraph`, N top logprobs, the step's shape: n decode rows, C chunk tokens, R prompts that
may finish, k decode steps) are bound with `functools.partial` before `jax.jit`. Shapes use the
letters of DESIGN.md: `B` rows (slots), `n` decode rows computed, `C` chunk tokens, `R` prompts
finishing, `PPS` pages per sequence, `W` = ceil(V/32) bitmask words.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from metrale_jax.config import ModelConfig
from metrale_jax.engine.sampling import SampleResult, sample
from metrale_jax.engine.sampling_state import SamplingState, TokenHistory
from metrale_jax.engine.state import DecodeState, StepOutput
from metrale_jax.models import seq2seq_ragged
from metrale_jax.models.kv_quant import is_quantized, stored_head_dim
from metrale_jax.models.layers import rms_norm
from metrale_jax.models.paged_attention import use_tpu_kernel
from metrale_jax.models.ragged import StepLayout, kernel_layout, ragged_layers
from metrale_jax.models.ragged import head as decoder_head
from metrale_jax.models.scanned import copy_pages, pool_page_size, zero_pools
from metrale_jax.models.seq2seq_ragged import CrossCache, Seq2SeqGraph
from metrale_jax.models.unrolled import LayerGraph, LayerParams
from metrale_jax.models.vision import encode_images as encode_vision
from metrale_jax.models.window_cache import (
    WindowedPools,
    ring_columns,
    ring_slots,
    window_table,
)


def _as_output(res: SampleResult) -> StepOutput:
    """A `SampleResult` of [R] arrays as a one-step `StepOutput` ([1, R])."""
    return StepOutput(res.tokens[None], res.logprobs[None], res.top_ids[None],
                      res.top_logprobs[None])


@dataclasses.dataclass(frozen=True)
class SampleConfig:
    """The static sampling settings of an engine: `num_top` (N) top logprobs per token and
    the logprobs mode ("raw" or "processed", see engine/sampling.py)."""

    num_top: int
    logprobs_mode: str = "raw"


@dataclasses.dataclass(frozen=True)
class StepShape:
    """The static shape of one compiled ragged step.

    n: decode rows computed (rows 0 .. n-1); chunk: C prefill tokens (0 = decode only);
    finish: R prompts whose first token the step may sample (0 when chunk is 0);
    decode_steps: k decode steps in the call (k > 1 only without a chunk); pooled: a step
    with a chunk also returns its finishing prompts' final-normed last hidden states
    (`EngineConfig.pooled_output`, `SampleInputs.pooled`).
    """

    n: int
    chunk: int
    finish: int
    decode_steps: int
    pooled: bool = False


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ChunkInputs:
    """The prefill tier of a ragged step (host data, shapes static).

    tokens, rows, positions: [C] int32, each chunk token, its row (-1 = padding) and its
    position in the row's sequence (a row's tokens contiguous and increasing);
    generated: [C] bool, tokens the row generated before it was preempted (fed again: they
    count for the penalties as generated tokens, not prompt tokens). A piece whose first
    position p0 is past 0 attends to positions 0 .. p0 - 1 of its row in the pages (an
    earlier piece of its prompt, or a prefix shared from the prefix cache);
    finish_index: [R] int32, the chunk index of the last prompt token of each prompt that
    ends in this step; finish_rows: [R] int32, their rows (B = none); finish_steps: [R]
    int32, the sampling step of each one's next token (0, or the tokens it generated before
    a preemption: its key folds in the same step index as if it had never stopped); sampling:
    [R] rows of
    `SamplingState`, their settings; allowed: [R, W] uint32, their first tokens' grammar masks;
    image_rows: [C] int32 for a vision-language model, each token's row of the image feature
    pool (`DecodeState.images`; -1: a text token), None otherwise.
    """

    tokens: jax.Array
    rows: jax.Array
    positions: jax.Array
    generated: jax.Array
    finish_index: jax.Array
    finish_rows: jax.Array
    finish_steps: jax.Array
    sampling: SamplingState
    allowed: jax.Array
    image_rows: jax.Array | None = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SampleInputs:
    """What a ragged step hands its sampling program (`sample_rows`): the M = n + R rows
    that draw a token this step, decode rows 0 .. n-1 first, then the R prompts that may end
    in its chunk.

    logits: [M, V] float32, the model's logits of each; rows: [M] int32, each one's row of
    the state (in 0 .. B-1: a padding entry names some row, its draw is discarded); write:
    [M] bool, whether the token becomes the row's next input (a decoding row, a prompt that
    ended); lengths: [M] int32, the valid positions of each row's token history; steps: [M]
    int32, the step index folded into each row's key; allowed: [M, W] uint32 grammar masks.
    pooled: [R, E] float32, the final-normed hidden state of each finishing prompt's last
    token (`StepShape.pooled`; None otherwise): not an input of the sampling program
    (`StepPrograms.run` moves it to the step's `StepOutput`); pooled_mean: [R, E] float32,
    the mean of those hidden states over each one's prompt (`StepOutput.pooled_mean`).
    """

    logits: jax.Array
    rows: jax.Array
    write: jax.Array
    lengths: jax.Array
    steps: jax.Array
    allowed: jax.Array
    pooled: jax.Array | None = None
    pooled_mean: jax.Array | None = None


@dataclasses.dataclass(frozen=True)
class SampleShape:
    """The static shape of one sampling program: n decode rows and R finishing prompts
    (M = n + R rows drawn; the output has B + R columns)."""

    n: int
    finish: int


def sample_rows(sc: SampleConfig, shape: SampleShape, state: DecodeState,
                inputs: SampleInputs) -> tuple[DecodeState, StepOutput]:
    """The sampling half of a one-token ragged step, its own program (compiled once per
    `SampleShape`, not copied into every step shape): each of the M rows of `inputs` draws
    its next token with its own settings and token history as the step left them in
    `state` (state donated); the rows with `write` take it as their next input. Returns the
    state and StepOutput `[1, B + R]` (column b: decode row b, B + r: the r-th finishing
    prompt; columns n .. B-1 zeros)."""
    B, n = state.tokens.shape[0], shape.n
    rows = inputs.rows
    gather = functools.partial(jax.tree.map, lambda a: a[rows])
    res = sample(inputs.logits, gather(state.sampling), gather(state.history), inputs.lengths,
                 inputs.steps, sc.num_top, sc.logprobs_mode, inputs.allowed)
    tokens = state.tokens.at[jnp.where(inputs.write, rows, B)].set(res.tokens, mode="drop")
    out = _as_output(res)
    dec = pad_columns(jax.tree.map(lambda a: a[:, :n], out), B)
    fin = jax.tree.map(lambda a: a[:, n:], out)
    return (dataclasses.replace(state, tokens=tokens),
            jax.tree.map(lambda a, b: jnp.concatenate([a, b], axis=1), dec, fin))


def init_state(cfg: ModelConfig, slots: int, length: int, num_pages: int, page_size: int,
               cache_dtype: jnp.dtype, source_len: int = 0, image_rows: int = 0,
               float_dtype: jnp.dtype | None = None, *,
               stacked_pages: bool = False, window_columns: int = 0,
               pooled: bool = False) -> DecodeState:
    """An empty decode state: greedy rows at position 0 and zero page pools
    (L x `[num_pages, page_size, 2K, D]`, or `D + 4` int8 rows with their scales for an int8
    cache: `models/kv_quant.py`; `stacked_pages`: one pool `[L, num_pages, ...]` for the
    scanned layer loop, `models/scanned.py`); the token history holds `length` positions; an
    encoder-decoder's rows hold sources of up to `source_len` tokens (`CrossCache`); a
    vision-language model's image feature pool holds `image_rows` rows `[image_rows, E]`.
    Those two are kept in `cache_dtype` when it is a float, else in `float_dtype` (None:
    float32). window_columns: W > 0 gives the sliding layers rings of W pages per row
    (`WindowedPools`, `models/window_cache.py`). pooled: the rows' prompt hidden-state sums
    (`DecodeState.pool_sums`, `[B, E]` float32) for mean pooling."""
    zeros = jnp.zeros((slots,), jnp.int32)
    shape = (num_pages, page_size, 2 * cfg.num_kv_heads,
             stored_head_dim(cfg.head_dim, cache_dtype))
    if window_columns:
        sliding = sum(bool(s) for s in cfg.layer_is_sliding)
        pages = WindowedPools(
            zero_pools(cfg.num_layers - sliding, shape, cache_dtype, stacked=stacked_pages),
            zero_pools(sliding, (slots * window_columns + 1, *shape[1:]), cache_dtype,
                       stacked=stacked_pages))
    else:
        pages = zero_pools(cfg.num_layers, shape, cache_dtype, stacked=stacked_pages)
    side = (jnp.dtype(float_dtype or jnp.float32) if is_quantized(cache_dtype)
            else cache_dtype)
    return DecodeState(
        pages=pages,
        positions=zeros, tokens=zeros, steps=zeros,
        sampling=SamplingState.device_defaults(slots, cfg.vocab_size),
        history=TokenHistory.zeros(slots, length, cfg.vocab_size),
        cross=(CrossCache.zeros(cfg, slots, source_len, side)
               if cfg.is_encoder_decoder else None),
        images=(jnp.zeros((image_rows, cfg.hidden_size), side)
                if cfg.vision is not None else None),
        pool_sums=jnp.zeros((slots, cfg.hidden_size), jnp.float32) if pooled else None)


def seed_history(state: DecodeState, row: jax.Array, tokens: jax.Array, length: jax.Array,
                 first_generated: jax.Array) -> DecodeState:
    """Sets row `row`'s token history to a sequence whose first `length` tokens come from the
    prefix cache (their keys and values are in shared pages, so no chunk carries them).

    tokens: [S] int32 (entries past `length` ignored); first_generated: int32, the position of
    the first token the sequence generated before a preemption (0 = all prompt): tokens from
    there count as generated, the others as prompt tokens. State donated; the rest of the
    state is unchanged (the row's piece, in the next step, adds the positions after them).
    """
    h = state.history
    V = h.counts.shape[1]
    idx = jnp.arange(tokens.shape[0], dtype=jnp.int32)
    real = idx < length
    gen = real & (first_generated > 0) & (idx >= first_generated)
    seen = jnp.zeros((V,), jnp.bool_).at[jnp.where(real & ~gen, tokens, V)].set(
        True, mode="drop")
    counts = jnp.zeros((V,), jnp.int32).at[jnp.where(gen, tokens, V)].add(1, mode="drop")
    history = TokenHistory(h.tokens.at[row].set(jnp.where(real, tokens, h.tokens[row])),
                           h.counts.at[row].set(counts), h.prompt_seen.at[row].set(seen))
    return dataclasses.replace(state, history=history)


def final_hidden(graph: LayerGraph, params: LayerParams, x: jax.Array) -> jax.Array:
    """A decoder's hidden states `[R, E]` through its final norm, as float32 `[R, E]` (what
    transformers' `*Model` returns as `last_hidden_state`; `models.ragged.head`'s norm)."""
    cfg = graph.cfg
    x = rms_norm(x, params.outer["final_norm"]["weight"][...], cfg.rms_norm_eps,
                 cfg.norm_weight_offset)
    return x.astype(jnp.float32)


def head(graph, params: LayerParams, x: jax.Array) -> jax.Array:
    """Hidden states `[R, E]` -> logits `[R, V] float32`, for either kind of model."""
    if isinstance(graph, Seq2SeqGraph):
        return seq2seq_ragged.head(graph, params, x)
    return decoder_head(graph, params, x)


def slot_of(table: jax.Array, positions: jax.Array, ok: jax.Array,
            page_size: int) -> jax.Array:
    """Flat pool slots `[...] int32` (page * page_size + offset) of `positions` `[...] int32`
    through page-table rows `table` `[..., PPS] int32`; where not `ok` `[...] bool`, a slot
    of the null page."""
    pps = table.shape[-1]
    page = jnp.take_along_axis(table, jnp.clip(positions // page_size, 0, pps - 1)[..., None],
                               axis=-1)[..., 0]
    return jnp.where(ok, page * page_size + positions % page_size, positions % page_size)


def with_window(layout: StepLayout, pages, dec_rows: jax.Array, token_rows: jax.Array,
                positions: jax.Array) -> StepLayout:
    """`layout` (a step's, in the paged pool) with its `window` set when `pages` are
    `WindowedPools` (the sliding layers' rings, `models/window_cache.py`); else unchanged.
    dec_rows: [n] int32, the row of each decode-tier token (n = `layout.dec_table` rows);
    token_rows: [T] int32, each token's row (-1: padding); positions: [T] int32. A token
    whose paged slot is on the null page (padding, an idle row) writes the rings' null page."""
    if not isinstance(pages, WindowedPools):
        return layout
    B, pps = layout.page_table.shape
    page_size = pool_page_size(pages)
    columns = ring_columns(pages, B)
    table = window_table(B, pps, columns)
    ok = (layout.slots >= page_size) & (token_rows >= 0)
    n = dec_rows.shape[0]
    kernel = None
    if layout.kernel is not None:
        kernel = kernel_layout(table, layout.dec_lens, layout.chunk_rows, positions[n:])
    window = StepLayout(
        slots=ring_slots(token_rows, positions, ok, columns, page_size),
        dec_table=table[jnp.clip(dec_rows, 0, B - 1)], dec_lens=layout.dec_lens,
        chunk_rows=layout.chunk_rows, page_table=table, kernel=kernel)
    return dataclasses.replace(layout, window=window)


def ragged_step(graph: LayerGraph, sc: SampleConfig, shape: StepShape, params: LayerParams,
                state: DecodeState, page_table: jax.Array, active: jax.Array,
                allowed: jax.Array, chunk: ChunkInputs | None, lora: tuple | None = None,
                lora_mix: jax.Array | None = None
                ) -> tuple[DecodeState, SampleInputs | StepOutput]:
    """One engine call: a decode step of rows `0 .. n-1` with a chunk of prompt tokens, up
    to the logits; or, without a chunk, k >= 1 decode steps, each drawing inside the call.

    page_table: [B, PPS] int32 (the host's `PageTable.table`, covering every position this
    call writes); active: [B] bool, the rows that decode (held rows keep their state);
    allowed: [B, W] uint32 grammar bitmasks of the decode rows; chunk: the prefill tier
    (None when `shape.chunk` is 0); lora: per layer the adapter slots' weights
    (`models/lora.py`; None: an engine without adapters), lora_mix: [B, N] float32, each
    row's weight per adapter slot (zeros: none). State donated. Each decode row feeds its
    last token at its position and advances; each prompt that ends in the chunk has its
    last token's logits taken and its row becomes ready to decode (position, step and
    settings set). With a chunk returns the state and the `SampleInputs` of `sample_rows`,
    the program that draws the n + R tokens (the rows' next inputs are written there: one
    sampling program for every chunk size); without one, each step draws with the sampler
    fused (`decode_steps`: the decode loop, where a second program per token cost 5% of
    float32 decode) and the call returns StepOutput `[k, B]`. A mixture-of-experts model's
    call returns `(those, counts [L, X] int32)`: its real tokens per layer and expert.
    With `shape.pooled` the `SampleInputs` also carry the finishing prompts' final-normed
    last hidden states (`pooled`, `[R, E]` float32: embeddings and rerank scores).
    """
    B, pps = state.tokens.shape[0], page_table.shape[1]
    page_size = pool_page_size(state.pages)
    cap = pps * page_size
    n, C = shape.n, shape.chunk
    head_rows = functools.partial(jax.tree.map, lambda a: a[:n])
    live = active[:n]
    dec_table = page_table[:n]

    def forward(pages, dec_tokens, dec_pos):
        """The model over this step's tokens -> (hidden [n + C, E], pages)."""
        ok = live & (dec_pos < cap)
        dec_lens = jnp.where(live, jnp.minimum(dec_pos + 1, cap), 0)
        slots = slot_of(dec_table, dec_pos, ok, page_size)
        tokens, positions = dec_tokens, dec_pos
        token_mix = lora_mix[:n] if lora is not None else None
        if C:
            real = chunk.rows >= 0
            rows = jnp.clip(chunk.rows, 0, B - 1)
            chunk_slots = slot_of(page_table[rows], chunk.positions, real, page_size)
            slots = jnp.concatenate([slots, chunk_slots])
            tokens = jnp.concatenate([dec_tokens, chunk.tokens])
            positions = jnp.concatenate([dec_pos, chunk.positions])
            chunk_rows = chunk.rows
            if lora is not None:
                token_mix = jnp.concatenate(
                    [token_mix, jnp.where(real[:, None], lora_mix[rows], 0.0)])
        else:
            chunk_rows = jnp.zeros((0,), jnp.int32)
        kernel = None
        if use_tpu_kernel():  # the whole step through JAX's Pallas kernel
            kernel = kernel_layout(page_table, dec_lens, chunk_rows,
                                   chunk.positions if C else jnp.zeros((0,), jnp.int32))
        layout = StepLayout(slots=slots, dec_table=dec_table, dec_lens=dec_lens,
                            chunk_rows=chunk_rows, page_table=page_table, kernel=kernel)
        dec_rows = jnp.arange(n, dtype=jnp.int32)
        layout = with_window(layout, pages, dec_rows,
                             jnp.concatenate([dec_rows, chunk_rows]) if C else dec_rows,
                             positions)
        if isinstance(graph, Seq2SeqGraph):  # the decoder, reading each row's source
            token_rows = jnp.arange(n, dtype=jnp.int32)
            if C:
                token_rows = jnp.concatenate([token_rows, jnp.clip(chunk.rows, 0, B - 1)])
            return seq2seq_ragged.ragged_layers(graph, params, pages, tokens, positions,
                                                layout, state.cross, token_rows, n=n)
        images = None
        if C and state.images is not None:  # image placeholders take their features
            images = (jnp.concatenate([jnp.full((n,), -1, jnp.int32), chunk.image_rows]),
                      state.images)
        return ragged_layers(graph, params, pages, tokens, positions, layout, n=n, lora=lora,
                             lora_mix=token_mix, images=images,
                             router_counts=graph.cfg.is_moe)  # + [L, X] (MoE only)

    h = state.history
    positions, tokens, steps_ = state.positions[:n], state.tokens[:n], state.steps[:n]
    if C == 0:  # the decode loop: its sampler fused (see `decode_steps`)
        return decode_steps(graph, sc, params, state, live, allowed[:n], forward, cap,
                            shape.decode_steps)
    dec_history = head_rows(h).append(tokens, positions, live)
    x, pages, *routed = forward(state.pages, tokens, positions)
    history = TokenHistory(h.tokens.at[:n].set(dec_history.tokens),
                           h.counts.at[:n].set(dec_history.counts), h.prompt_seen)
    new_positions = state.positions.at[:n].set(
        jnp.where(live, jnp.minimum(positions + 1, cap), positions))
    new_steps = state.steps.at[:n].set(jnp.where(live, steps_ + 1, steps_))
    dec_rows = jnp.arange(n, dtype=jnp.int32)
    # The chunk's prompt tokens go into their rows' histories; a row whose chunk starts at
    # position 0 starts afresh (counts and prompt_seen cleared first).
    real = chunk.rows >= 0
    rows = jnp.where(real, chunk.rows, B)
    fresh = jnp.where(real & (chunk.positions == 0), chunk.rows, B)
    prompt_rows = jnp.where(chunk.generated, B, rows)
    seen = history.prompt_seen.at[fresh].set(False, mode="drop")
    seen = seen.at[prompt_rows, chunk.tokens].set(True, mode="drop")
    counts = history.counts.at[fresh].set(0, mode="drop")
    counts = counts.at[jnp.where(chunk.generated, rows, B), chunk.tokens].add(1, mode="drop")
    history = TokenHistory(
        history.tokens.at[rows, chunk.positions].set(chunk.tokens, mode="drop"), counts, seen)
    finish_rows = chunk.finish_rows
    last_pos = chunk.positions[chunk.finish_index]
    pooled = pooled_mean = pool_sums = None
    if shape.pooled:  # each chunk token's normed state joins its row's sum
        normed = final_hidden(graph, params, x[n:])
        pool_sums = state.pool_sums.at[fresh].set(0.0, mode="drop")
        pool_sums = pool_sums.at[rows].add(normed, mode="drop")
        pooled = normed[chunk.finish_index]
        pooled_mean = (pool_sums[jnp.clip(finish_rows, 0, B - 1)]
                       / (last_pos + 1).astype(jnp.float32)[:, None])
    new = DecodeState(
        pages,
        new_positions.at[finish_rows].set(last_pos + 1, mode="drop"),
        state.tokens,
        new_steps.at[finish_rows].set(chunk.finish_steps + 1, mode="drop"),
        state.sampling.set_rows(finish_rows, chunk.sampling), history, state.cross,
        state.images, pool_sums)
    hidden = jnp.concatenate([x[:n], x[n + chunk.finish_index]])
    inputs = SampleInputs(
        head(graph, params, hidden),
        jnp.concatenate([dec_rows, jnp.clip(finish_rows, 0, B - 1)]),
        jnp.concatenate([live, (finish_rows >= 0) & (finish_rows < B)]),
        jnp.concatenate([positions + 1, last_pos + 1]),
        jnp.concatenate([steps_, chunk.finish_steps]),
        jnp.concatenate([allowed[:n], chunk.allowed]), pooled, pooled_mean)
    return new, ((inputs, routed[0]) if routed else inputs)


def decode_steps(graph: LayerGraph, sc: SampleConfig, params: LayerParams, state: DecodeState,
                 live: jax.Array, allowed: jax.Array, forward, cap: int,
                 k: int) -> tuple[DecodeState, StepOutput]:
    """k >= 1 decode steps of rows 0 .. n-1 in one call (`ragged_step` without a chunk), the
    sampler fused into each: live [n] bool, the rows that decode; allowed [n, W] uint32;
    forward: the model over (pages, tokens [n], positions [n]) -> (hidden [n, E], pages);
    cap: the positions a row may hold. Returns the state and StepOutput `[k, B]` (a
    mixture-of-experts model: with its tokens per layer and expert `[L, X]`, summed over
    the k steps)."""
    B, n = state.tokens.shape[0], live.shape[0]
    h = state.history
    sampling = jax.tree.map(lambda a: a[:n], state.sampling)

    def one(carry, _):
        pages, positions, tokens, steps_, history = carry
        history = history.append(tokens, positions, live)
        x, pages, *routed = forward(pages, tokens, positions)
        res = sample(head(graph, params, x), sampling, history, positions + 1, steps_,
                     sc.num_top, sc.logprobs_mode, allowed)
        return (pages, jnp.where(live, jnp.minimum(positions + 1, cap), positions),
                jnp.where(live, res.tokens, tokens), jnp.where(live, steps_ + 1, steps_),
                history), (res, routed)

    carry = (state.pages, state.positions[:n], state.tokens[:n], state.steps[:n],
             jax.tree.map(lambda a: a[:n], h))
    if k == 1:
        carry, (res, routed) = one(carry, None)
        out = StepOutput(res.tokens[None], res.logprobs[None], res.top_ids[None],
                         res.top_logprobs[None])
    else:
        carry, (res, routed) = jax.lax.scan(one, carry, None, length=k)
        out = StepOutput(res.tokens, res.logprobs, res.top_ids, res.top_logprobs)
        routed = [r.sum(axis=0) for r in routed]
    pages, positions, tokens, steps_, dec_history = carry
    history = TokenHistory(h.tokens.at[:n].set(dec_history.tokens),
                           h.counts.at[:n].set(dec_history.counts), h.prompt_seen)
    new = DecodeState(pages, state.positions.at[:n].set(positions),
                      state.tokens.at[:n].set(tokens), state.steps.at[:n].set(steps_),
                      state.sampling, history, state.cross, state.images, state.pool_sums)
    out = pad_columns(out, B)
    return new, ((out, routed[0]) if routed else out)


def pad_columns(out: StepOutput, columns: int) -> StepOutput:
    """`out` (`[k, c, ...]` per field) padded with zeros to `[k, columns, ...]`."""
    c = out.tokens.shape[1]
    if c == columns:
        return out
    return jax.tree.map(
        lambda a: jnp.pad(a, [(0, 0), (0, columns - c)] + [(0, 0)] * (a.ndim - 2)), out)


def beam_set(state: DecodeState, rows: jax.Array, tokens: jax.Array, positions: jax.Array,
             src_pages: jax.Array, dst_pages: jax.Array) -> DecodeState:
    """Beam search's step between two decode steps (state donated): rows: [B] bool, the rows
    whose next input becomes `tokens[b]` at `positions[b]` ([B] int32); then every pool's
    page `dst_pages[i]` becomes a copy of page `src_pages[i]` ([B] int32 each, 0 -> 0 for
    unused entries: the null page onto itself), a forked beam's own copy of its parent's
    partly written last page."""
    pages = copy_pages(state.pages, dst_pages, src_pages)
    return dataclasses.replace(
        state, pages=pages, tokens=jnp.where(rows, tokens, state.tokens),
        positions=jnp.where(rows, positions, state.positions))


def encode(graph: Seq2SeqGraph, params: LayerParams, state: DecodeState, rows: jax.Array,
           ids: jax.Array, lens: jax.Array) -> DecodeState:
    """An encoder-decoder's encoder over the sources of rows being admitted (state donated):
    rows [R] int32 (B = unused), ids [R, S'] int32 (right-padded to a source bucket), lens [R]
    int32; each row's cross-attention keys and values are written (`encode_sources`)."""
    cross = seq2seq_ragged.encode_sources(graph, params, state.cross, rows, ids, lens)
    return dataclasses.replace(state, cross=cross)


def copy_sources(state: DecodeState, dst: jax.Array, src: jax.Array) -> DecodeState:
    """Rows `dst[i]` take rows `src[i]`'s sources ([B] int32 each; dst B = unused): forked
    beams of a request whose rows did not hold its source yet (state donated)."""
    return dataclasses.replace(state, cross=seq2seq_ragged.copy_rows(state.cross, dst, src))


def encode_images(vision_def: nnx.GraphDef, vision_params: nnx.State, state: DecodeState,
                  pixels: jax.Array, dst: jax.Array) -> DecodeState:
    """A vision-language model's vision encoder over images being admitted (state donated):
    pixels [N, C, H, W] float32 (the image processor's output), dst [N] int32, each image's
    slot of the feature pool (>= the pool's slots: unused); image i's `[T_img, E]` features
    are written to pool rows `dst[i] * T_img ..`."""
    feats = encode_vision(vision_def, vision_params, pixels)
    _, T, E = feats.shape
    pool = state.images.reshape(-1, T, E)
    pool = pool.at[dst].set(feats.astype(pool.dtype), mode="drop")
    return dataclasses.replace(state, images=pool.reshape(-1, E))
