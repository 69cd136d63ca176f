"""The pure functions the engine compiles: prefill, insert, chunked prefill, decode, init.

Each takes params and state as arguments (never closed over); the static parts (the model's
`LayerGraph`, N top logprobs, k decode steps, shapes) are bound with `functools.partial` before
`jax.jit`. The model runs unrolled over per-layer params (`models.unrolled`): on XLA:CPU a layer
scan copies every layer's weights and cache out of the stacked arrays at each step.
Shapes use the letters of DESIGN.md: `Bp` prefill batch, `P` prefill bucket.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from metrale_jax.config import ModelConfig
from metrale_jax.engine.sampling import SampleResult, sample
from metrale_jax.engine.sampling_state import SamplingState, TokenHistory
from metrale_jax.engine.state import DecodeState, StepOutput
from metrale_jax.models.kv_cache import KVCache
from metrale_jax.models.unrolled import (
    LayerCache,
    LayerGraph,
    LayerParams,
    decode_layers,
    forward_layers,
)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Prefix:
    """A prefilled batch of prompts, ready for `insert`.

    cache: KVCache k/v `[L, Bp, K, P, D]` of the prompt tokens (positions 0 .. P-1);
    lengths: [Bp] int32, the true prompt lengths; first: StepOutput `[1, Bp]`, the token
    sampled (step 0) from each prompt's last logits; sampling: the rows' `SamplingState`;
    history: the prompts' `TokenHistory` (tokens [Bp, P]).
    """

    cache: KVCache
    lengths: jax.Array
    first: StepOutput
    sampling: SamplingState
    history: TokenHistory


def _as_output(res: SampleResult) -> StepOutput:
    """A `SampleResult` of [B] arrays as a one-step `StepOutput` ([1, B])."""
    return StepOutput(res.tokens[None], res.logprobs[None], res.top_ids[None],
                      res.top_logprobs[None])


@dataclasses.dataclass(frozen=True)
class SampleConfig:
    """The static sampling settings of an engine: `num_top` (N) top logprobs per token and
    the logprobs mode ("raw" or "processed", see engine/sampling.py)."""

    num_top: int
    logprobs_mode: str = "raw"


def init_state(cfg: ModelConfig, slots: int, length: int, cache_dtype: jnp.dtype) -> DecodeState:
    """An empty decode state: greedy slots at position 0 and a zero `LayerCache`."""
    zeros = jnp.zeros((slots,), jnp.int32)
    return DecodeState(
        cache=LayerCache.zeros(cfg, slots, length, cache_dtype), positions=zeros, tokens=zeros,
        steps=zeros, sampling=SamplingState.device_defaults(slots, cfg.vocab_size),
        history=TokenHistory.zeros(slots, length, cfg.vocab_size))


def prefill_step(graph: LayerGraph, sc: SampleConfig, cache_dtype: jnp.dtype,
                 params: LayerParams, tokens: jax.Array, lengths: jax.Array,
                 sampling: SamplingState, allowed: jax.Array | None = None) -> Prefix:
    """Runs `Bp` prompts and samples each one's first token.

    tokens: [Bp, P] int32, prompt b in `tokens[b, :lengths[b]]` (padding after it is never
    attended to by real tokens); lengths: [Bp] int32 in 1 .. P; sampling: [Bp] rows;
    allowed: [Bp, ceil(V/32)] uint32 grammar bitmasks of the first tokens (None = all).
    """
    Bp, P = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(P, dtype=jnp.int32), (Bp, P))
    logits, kv = forward_layers(graph, params, tokens, positions, None, lengths - 1)
    history = TokenHistory.of_prompts(tokens, lengths, logits.shape[-1])
    res = sample(logits, sampling, history, lengths, jnp.zeros((Bp,), jnp.int32), sc.num_top,
                 sc.logprobs_mode, allowed)
    kv = KVCache(kv.k.astype(cache_dtype), kv.v.astype(cache_dtype))
    return Prefix(kv, lengths, _as_output(res), sampling, history)


def insert_step(prefix: Prefix, state: DecodeState, slots: jax.Array, cols: jax.Array,
                first: StepOutput) -> tuple[DecodeState, StepOutput]:
    """Writes a prefix into the decode state (donated) at `slots: [Bp] int32`.

    Row b goes to slot `slots[b]` and its first token to column `cols[b]` of `first`
    (`[1, B]`, donated); an index equal to B (padding rows) is dropped.
    """
    P = prefix.cache.k.shape[3]
    kt = tuple(c.at[slots, :, :, :P].set(new.swapaxes(-1, -2).astype(c.dtype), mode="drop")
               for c, new in zip(state.cache.kt, prefix.cache.k, strict=True))
    v = tuple(c.at[slots, :, :P].set(new.astype(c.dtype), mode="drop")
              for c, new in zip(state.cache.v, prefix.cache.v, strict=True))
    cache = LayerCache(kt, v)
    h, ph = state.history, prefix.history
    history = TokenHistory(h.tokens.at[slots, :P].set(ph.tokens, mode="drop"),
                           h.counts.at[slots].set(0, mode="drop"),
                           h.prompt_seen.at[slots].set(ph.prompt_seen, mode="drop"))
    state = DecodeState(
        cache=cache,
        positions=state.positions.at[slots].set(prefix.lengths, mode="drop"),
        tokens=state.tokens.at[slots].set(prefix.first.tokens[0], mode="drop"),
        steps=state.steps.at[slots].set(1, mode="drop"),
        sampling=state.sampling.set_rows(slots, prefix.sampling), history=history)
    first = jax.tree.map(lambda a, b: a.at[:, cols].set(b, mode="drop"), first, prefix.first)
    return state, first


def prefill_insert_step(graph: LayerGraph, sc: SampleConfig, cache_dtype: jnp.dtype,
                        params: LayerParams, state: DecodeState, first: StepOutput,
                        tokens: jax.Array, lengths: jax.Array, sampling: SamplingState,
                        slots: jax.Array, cols: jax.Array,
                        allowed: jax.Array) -> tuple[DecodeState, StepOutput]:
    """`prefill_step` then `insert_step` in one program (state and first donated).

    The batching loop's path: one compiled program per (bucket, prefill batch) instead of
    two, which halves warmup, and the prefix never leaves the program.
    """
    prefix = prefill_step(graph, sc, cache_dtype, params, tokens, lengths, sampling, allowed)
    return insert_step(prefix, state, slots, cols, first)


def chunk_step(graph: LayerGraph, sc: SampleConfig, params: LayerParams, state: DecodeState,
               first: StepOutput, slot: jax.Array, col: jax.Array, tokens: jax.Array,
               start: jax.Array, length: jax.Array, sampling: SamplingState,
               allowed: jax.Array) -> tuple[DecodeState, StepOutput]:
    """One chunk of a long prompt, prefilled straight into slot `slot`'s cache.

    tokens: [1, P] int32 at positions `start .. start + P - 1`, of which the first
    `length` are real; the chunk attends to the slot's cache below `start` (earlier chunks).
    The slot ends at position `start + length` with its first token sampled from the chunk's
    last real token: after the final chunk it is ready to decode. state and first (`[1, B]`,
    column `col` written) are donated. slot, col, start, length: int32 scalars.
    """
    P = tokens.shape[1]
    # The slot's cache as a one-row KVCache [L, 1, K, S, D] (a copy: chunks are rare and long).
    take = functools.partial(jax.lax.dynamic_slice_in_dim, start_index=slot, slice_size=1, axis=0)
    sub = KVCache(jnp.stack([take(c).swapaxes(-1, -2) for c in state.cache.kt]),
                  jnp.stack([take(c) for c in state.cache.v]))
    positions = (start + jnp.arange(P, dtype=jnp.int32))[None]
    logits, sub = forward_layers(graph, params, tokens, positions, sub, (length - 1)[None])
    rows = slot[None]
    V = logits.shape[-1]
    h = state.history
    real = jnp.arange(P) < length
    seen = jnp.zeros((V,), jnp.bool_).at[jnp.where(real, tokens[0], V)].set(True, mode="drop")
    seen |= jnp.where(start > 0, h.prompt_seen[slot], False)
    history = TokenHistory(h.tokens.at[slot, start + jnp.arange(P)].set(tokens[0], mode="drop"),
                           h.counts.at[rows].set(0), h.prompt_seen.at[rows].set(seen[None]))
    row = TokenHistory(history.tokens[rows], history.counts[rows], seen[None])
    res = sample(logits, sampling, row, (start + length)[None], jnp.zeros((1,), jnp.int32),
                 sc.num_top, sc.logprobs_mode, allowed)
    put = functools.partial(jax.lax.dynamic_update_slice_in_dim, start_index=slot, axis=0)
    kt = tuple(put(c, sub.k[i].swapaxes(-1, -2).astype(c.dtype))
               for i, c in enumerate(state.cache.kt))
    v = tuple(put(c, sub.v[i].astype(c.dtype)) for i, c in enumerate(state.cache.v))
    state = DecodeState(
        cache=LayerCache(kt, v),
        positions=state.positions.at[rows].set(start + length),
        tokens=state.tokens.at[rows].set(res.tokens),
        steps=state.steps.at[rows].set(1),
        sampling=state.sampling.set_rows(rows, sampling), history=history)
    out = _as_output(res)
    first = jax.tree.map(lambda a, b: a.at[:, col[None]].set(b), first, out)
    return state, first


def generate_step(graph: LayerGraph, sc: SampleConfig, decode_steps: int, rows: int,
                  params: LayerParams, state: DecodeState, active: jax.Array,
                  allowed: jax.Array) -> tuple[DecodeState, StepOutput]:
    """`decode_steps` decode steps for the first `rows` slots; state donated.

    Only slots `0 .. rows-1` are computed (`rows` is static: one program per active-slot
    bucket, so one request in a 16-slot engine costs one row, not sixteen); active: [B] bool
    marks the slots that advance (holding a request and not held back: a held slot keeps its
    position, token, step and history, so it repeats the step later), and attention reads the
    cache only as far as the largest active position; allowed: [B, ceil(V/32)] uint32 grammar
    bitmasks (all ones = unconstrained). Each step feeds `tokens` at `positions`, writes
    their keys and values into the cache and the tokens into the history, samples the next
    token with key
    `fold_in(keys[b], steps[b])`, and advances positions (capped at S) and steps. Returns the
    new state and StepOutput `[k, B]` (rows past `rows` are zeros).
    """
    S = state.cache.length
    B = state.tokens.shape[0]
    head = functools.partial(jax.tree.map, lambda a: a[:rows])
    sampling = head(state.sampling)
    live = active[:rows]
    allowed = allowed[:rows]

    def one(carry):
        cache, positions, tokens, steps_, history = carry
        history = history.append(tokens, positions, live)
        logits, cache = decode_layers(graph, params, tokens, positions, cache, live)
        res = sample(logits, sampling, history, positions + 1, steps_, sc.num_top,
                     sc.logprobs_mode, allowed)
        # A held row writes the same key/value at the same position again later: harmless.
        return (cache, jnp.where(live, jnp.minimum(positions + 1, S), positions),
                jnp.where(live, res.tokens, tokens), jnp.where(live, steps_ + 1, steps_),
                history), res

    carry = (state.cache, state.positions[:rows], state.tokens[:rows], state.steps[:rows],
             head(state.history))
    if decode_steps == 1:
        carry, res = one(carry)
        out = _as_output(res)
    else:
        carry, res = jax.lax.scan(lambda c, _: one(c), carry, None, length=decode_steps)
        out = StepOutput(res.tokens, res.logprobs, res.top_ids, res.top_logprobs)
    cache, positions, tokens, steps_, history = carry
    h = state.history
    new = DecodeState(cache, state.positions.at[:rows].set(positions),
                      state.tokens.at[:rows].set(tokens), state.steps.at[:rows].set(steps_),
                      state.sampling,
                      TokenHistory(h.tokens.at[:rows].set(history.tokens),
                                   h.counts.at[:rows].set(history.counts), h.prompt_seen))
    if rows < B:  # pad the output to [k, B]
        out = jax.tree.map(lambda a: jnp.pad(a, [(0, 0), (0, B - rows)] + [(0, 0)] * (a.ndim - 2)),
                           out)
    return new, out
