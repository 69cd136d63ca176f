"""Engine behaviour on a tiny random Llama: batch invariance, seeds, compiles, limits."""

from __future__ import annotations

import numpy as np
import pytest
from jax import monitoring

from metrale_jax.engine import SlotSettings
from metrale_jax.errors import ContextLengthError

NEW = 12


def run(engine, items, new_tokens=NEW):
    """Adds `items` to a fresh state and decodes; returns {slot: (tokens, logprobs)}."""
    state = engine.init_decode_state()
    state, first = engine.add(state, items)
    first = first.to_numpy()
    toks = {slot: [int(first.tokens[0, i])] for i, (slot, _, _) in enumerate(items)}
    lps = {slot: [float(first.logprobs[0, i])] for i, (slot, _, _) in enumerate(items)}
    for _ in range(new_tokens - 1):
        state, out = engine.step(state)
        out = out.to_numpy()
        for slot, _, _ in items:
            toks[slot].extend(out.tokens[:, slot].tolist())
            lps[slot].extend(out.logprobs[:, slot].tolist())
    return {s: (toks[s], lps[s]) for s in toks}


def mixed_items(rng):
    settings = [SlotSettings(), SlotSettings(temperature=1.0, seed=1),
                SlotSettings(temperature=0.8, top_k=20, seed=2),
                SlotSettings(temperature=1.2, top_p=0.9, seed=3),
                SlotSettings(temperature=1.0, min_p=0.1, seed=4),
                SlotSettings(temperature=0.7, top_k=300, top_p=0.95, seed=5)]
    lengths = [1, 17, 40, 9, 32, 70]  # buckets 16 and 32, and two chunked prompts
    return [(slot, rng.integers(0, 512, n).tolist(), st)
            for slot, (n, st) in zip([5, 0, 3, 7, 1, 6], zip(lengths, settings, strict=True),
                                     strict=True)]


def check_batch_invariance_and_seeds(engine) -> None:
    """`mixed_items` decoded together twice (seeds reproduce) and each alone in another slot:
    the same tokens, logprobs within float32 rounding."""
    items = mixed_items(np.random.default_rng(0))
    together = run(engine, items)
    again = run(engine, items)
    for slot, _, st in items:
        assert together[slot][0] == again[slot][0], f"seed {st.seed} not reproducible"
    for i, (slot, prompt, st) in enumerate(items):
        alone_slot = (slot + 1 + i) % engine.config.max_slots  # another slot, alone
        alone = run(engine, [(alone_slot, prompt, st)])[alone_slot]
        assert alone[0] == together[slot][0], f"item {i} ({st}) differs alone"
        np.testing.assert_allclose(alone[1], together[slot][1], rtol=1e-4, atol=1e-5)


@pytest.mark.accelerator
def test_batch_invariance_and_seeds(tiny_engine):
    check_batch_invariance_and_seeds(tiny_engine)


def test_sampled_tokens_differ_by_seed(tiny_engine):
    prompt = list(range(10))
    a = run(tiny_engine, [(0, prompt, SlotSettings(temperature=1.0, seed=1)),
                          (1, prompt, SlotSettings(temperature=1.0, seed=2))])
    assert a[0][0] != a[1][0]


@pytest.mark.accelerator
def test_compile_count_flat_after_warmup(tiny_engine):
    cfg = tiny_engine.config
    before = tiny_engine.compile_count
    backend = []
    watching = [True]

    def listener(event: str, duration: float, **_) -> None:
        if watching[0] and "backend_compile" in event:
            backend.append(event)

    monitoring.register_event_duration_secs_listener(listener)
    try:
        rng = np.random.default_rng(1)
        for _ in range(4):
            state = tiny_engine.init_decode_state()
            n = int(rng.integers(1, cfg.max_slots + 1))
            slots = rng.permutation(cfg.max_slots)[:n]
            items = []
            for slot in slots:
                length = int(rng.integers(1, cfg.max_len - 4))
                st = SlotSettings(temperature=float(rng.choice([0.0, 0.5, 1.0])),
                                  top_k=int(rng.choice([0, 1, 50, 1000])),
                                  top_p=float(rng.choice([1.0, 0.9, 0.3])),
                                  min_p=float(rng.choice([0.0, 0.05])),
                                  seed=int(rng.integers(0, 2**40)))
                items.append((int(slot), rng.integers(0, 512, length).tolist(), st))
            state, first = tiny_engine.add(state, items)
            first.copy_to_host_async()
            for _ in range(3):
                state, out = tiny_engine.step(state)
                out.copy_to_host_async()
            np.asarray(out.tokens)
    finally:
        watching[0] = False
    assert tiny_engine.compile_count == before
    assert not backend, f"XLA compiled {len(backend)} programs after warmup"


def test_too_long_prompt_raises(tiny_engine):
    state = tiny_engine.init_decode_state()
    limit = tiny_engine.config.max_len
    with pytest.raises(ContextLengthError) as err:
        tiny_engine.add(state, [(0, [1] * limit, SlotSettings())])
    assert str(limit) in err.value.message and str(limit - 1) in err.value.message
    assert err.value.code == "context_length_exceeded"
    # The longest prompt that fits works, and its first token lands at position max_len - 1.
    state, _ = tiny_engine.add(state, [(0, [1] * (limit - 1), SlotSettings())])
    assert int(np.asarray(state.positions)[0]) == limit - 1
