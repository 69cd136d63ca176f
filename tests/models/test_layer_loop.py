"""The layer loop's two forms (`EngineConfig.layer_loop`, `models/scanned.py`): the scanned
form (a `lax.scan` over stacked params and one stacked page pool) gives the unrolled form's
logits for every decoder family, with int8 and int4 weights and an int8 KV cache, and an
engine in scanned form gives the unrolled engine's tokens (LoRA adapters, beam page copies and
chunked prompts included)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from metrale_jax.engine import EngineConfig, SlotSettings
from metrale_jax.engine.config import default_layer_loop
from metrale_jax.errors import InvalidParameterError
from metrale_jax.models.lora import MODULES, module_shape
from metrale_jax.models.quantized_model import quantize_state
from metrale_jax.models.ragged import sequence_logits
from metrale_jax.models.scanned import (
    StackedLayerParams,
    copy_pages,
    layer_group,
    pool_page_size,
    stack_layers,
    zero_pools,
)
from metrale_jax.models.transformer import Transformer
from metrale_jax.models.unrolled import split_layers
from tests.engine.conftest import TINY, make_engine
from tests.models.test_quant import ARCHS, random_model

LAYERS = 4  # the scan runs several iterations (Gemma 2: two pairs)


def deep_model(arch: str):
    """`random_model(arch)` with `LAYERS` layers (Gemma 2 alternating sliding and global,
    Gemma 3 three sliding to one global)."""
    kinds = {"gemma2": (True, False) * (LAYERS // 2), "gemma3": (True, True, True, False)}
    extra = {"sliding_layers": kinds[arch]} if arch in kinds else {}
    cfg, _, _ = random_model(arch)
    cfg = dataclasses.replace(cfg, num_layers=LAYERS, **extra)
    graphdef, params = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))
    rng = np.random.default_rng(0)
    params = jax.tree.map(
        lambda x: x if x.ndim > 1 else x + 0.1 * rng.standard_normal(x.shape, np.float32),
        params)
    return cfg, graphdef, params


def both_forms(graphdef, params, ids, **kw) -> tuple[np.ndarray, np.ndarray]:
    """The logits of `ids` through the paged path (chunks of 16: later chunks read earlier
    ones from the pages), unrolled and scanned."""
    graph, layers = split_layers(graphdef, params)
    sgraph, stacked = stack_layers(graphdef, params)
    assert isinstance(stacked, StackedLayerParams)
    unrolled = sequence_logits(graph, layers, ids, page_size=8, chunk=16, **kw)
    scanned = sequence_logits(sgraph, stacked, ids, page_size=8, chunk=16, **kw)
    return np.asarray(unrolled), np.asarray(scanned)


def assert_same_logits(a: np.ndarray, b: np.ndarray) -> None:
    """Equal within float32 rounding, relative to the largest logit."""
    np.testing.assert_allclose(b, a, rtol=0, atol=1e-4 * np.abs(a).max())


@pytest.mark.parametrize("arch", list(ARCHS))
def test_scanned_logits_match_unrolled_for_every_family(arch):
    cfg, graphdef, params = deep_model(arch)
    ids = np.random.default_rng(1).integers(0, cfg.vocab_size, 40).tolist()
    assert_same_logits(*both_forms(graphdef, params, ids))


@pytest.mark.parametrize("arch, weights, cache", [("llama", "int8", jnp.int8),
                                                  ("gemma2", "int4", jnp.float32),
                                                  ("qwen3", "int8-all", jnp.int8)])
def test_scanned_logits_match_with_quantized_weights_and_int8_cache(arch, weights, cache):
    cfg, _, params = deep_model(arch)
    _, graphdef, qparams = quantize_state(cfg, params, weights)
    ids = np.random.default_rng(2).integers(0, cfg.vocab_size, 40).tolist()
    assert_same_logits(*both_forms(graphdef, qparams, ids, cache_dtype=cache))


def test_layer_groups_follow_the_period_of_layer_kinds():
    def group(kinds):
        return layer_group(SimpleNamespace(layer_is_sliding=tuple(kinds)))
    assert group([False] * 6) == 1
    assert group([True, False] * 3) == 2
    assert group([True, True, False] * 2) == 3
    assert group([True, False, False]) == 3  # no period divides L: one iteration of all


@pytest.mark.parametrize("stacked", [False, True])
def test_page_copies_and_page_size_in_either_pool_form(stacked):
    pools = zero_pools(3, (5, 4, 2, 8), jnp.float32, stacked=stacked)
    fill = jnp.arange(3 * 5 * 4 * 2 * 8, dtype=jnp.float32).reshape(3, 5, 4, 2, 8)
    pools = fill if stacked else tuple(fill)
    out = copy_pages(pools, jnp.array([2, 0]), jnp.array([4, 0]))
    got = np.asarray(out if stacked else jnp.stack(out))
    want = np.asarray(fill).copy()
    want[:, 2] = want[:, 4]
    np.testing.assert_array_equal(got, want)
    assert pool_page_size(pools) == 4


def test_the_setting_is_checked_and_defaults_per_backend():
    with pytest.raises(InvalidParameterError, match="layer_loop"):
        EngineConfig(layer_loop="rolled")
    assert default_layer_loop("cpu") == "unrolled"
    assert default_layer_loop("cpu", "int4") == "scan"
    assert default_layer_loop("cpu", "int4", layer_group=6) == "unrolled"  # Gemma 3's layers
    assert default_layer_loop("cpu", "int8") == default_layer_loop("cpu", "int8-all") == "unrolled"
    assert EngineConfig().scans_layers(quantization="int4")
    assert not EngineConfig().scans_layers() and not EngineConfig().scans_layers(
        quantization="int8")
    assert default_layer_loop("tpu") == default_layer_loop("gpu") == "scan"
    assert EngineConfig(layer_loop="scan").scans_layers()
    assert not EngineConfig(layer_loop="scan").scans_layers(encoder_decoder=True)


# ---- the engine in both forms --------------------------------------------------------------
ENGINE = dict(max_slots=4, max_len=96, max_loras=1, max_lora_rank=4)


def random_adapter(cfg, rank: int = 4):
    """A LoRA adapter on every projection with random a and b (`lora_slots.Adapter`)."""
    rng = np.random.default_rng(5)
    weights = {}
    for m in MODULES:
        fan_in, fan_out = module_shape(cfg, m)
        weights[m] = (rng.standard_normal((cfg.num_layers, fan_in, rank), np.float32) * 0.3,
                      rng.standard_normal((cfg.num_layers, rank, fan_out), np.float32) * 0.3)
    return SimpleNamespace(rank=rank, scale=1.0, weights=weights)


def decode(engine, adapter) -> dict[int, tuple[list[int], list[float]]]:
    """Four prompts (one chunked, one greedy with the adapter from its second token, the same
    prompt without it, one seeded), then 5 decode steps; a beam-style page copy of row 0's
    first page onto a fresh page in between (`beam_set`). Returns {slot: (tokens, logprobs)}."""
    rng = np.random.default_rng(4)
    short = rng.integers(0, TINY.vocab_size, 9).tolist()
    items = [(0, rng.integers(0, TINY.vocab_size, 40).tolist(), SlotSettings()),
             (1, short, SlotSettings()), (2, short, SlotSettings()),
             (3, rng.integers(0, TINY.vocab_size, 17).tolist(),
              SlotSettings(temperature=1.0, seed=7))]
    engine.set_lora(0, adapter)
    state = engine.init_decode_state()
    state, first = engine.add(state, items)
    engine.lora_slots.set_row(1, ((0, 1.0),))
    out = {s: ([int(first.tokens[0, i])], [float(first.logprobs[0, i])])
           for i, (s, _, _) in enumerate(items)}
    for step in range(5):
        state, res = engine.step(state)
        res = res.to_numpy()
        for s in out:
            out[s][0].extend(res.tokens[:, s].tolist())
            out[s][1].extend(res.logprobs[:, s].tolist())
        if step == 2:
            state = copy_first_page(engine, state)
    return out


def copy_first_page(engine, state):
    """Beam search's page copy through the engine's program: the last free page becomes a
    copy of row 0's first page (no row reads it; the copy must leave every row's pages as
    they were)."""
    from metrale_jax.engine import steps
    B = engine.config.max_slots
    src = np.zeros(B, np.int32)
    dst = np.zeros(B, np.int32)
    src[0], dst[0] = int(engine.pages.table[0, 0]), engine.config.resolved_num_pages - 1
    rows = np.zeros(B, bool)
    fn = jax.jit(steps.beam_set, donate_argnums=(0,))
    tokens, positions = np.asarray(state.tokens), np.asarray(state.positions)
    out = fn(state, rows, tokens, positions, src, dst)
    pages = out.pages
    copied = pages[:, dst[0]] if not isinstance(pages, tuple) else jnp.stack(
        [p[dst[0]] for p in pages])
    source = pages[:, src[0]] if not isinstance(pages, tuple) else jnp.stack(
        [p[src[0]] for p in pages])
    np.testing.assert_array_equal(np.asarray(copied), np.asarray(source))
    return out


@pytest.mark.parametrize("quantized", [{}, {"quantization": "int8", "cache_dtype": "int8"}],
                         ids=["float32", "int8-weights-and-cache"])
def test_an_engine_in_scanned_form_gives_the_unrolled_tokens(quantized):
    cfg = dataclasses.replace(TINY, num_layers=LAYERS)
    graphdef, params = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))
    params = jax.tree.map(lambda x: x * 10.0 if x.ndim > 1 else x, params)
    adapter = random_adapter(cfg)
    runs = {}
    for loop in ("unrolled", "scan"):
        engine = make_engine(cfg, graphdef, params, layer_loop=loop, **ENGINE, **quantized)
        assert isinstance(engine.params, StackedLayerParams) == (loop == "scan")
        runs[loop] = decode(engine, adapter)
        assert runs[loop][1][0] != runs[loop][2][0]  # the adapter changes row 1's tokens
    assert runs["scan"].keys() == runs["unrolled"].keys()
    for slot, (tokens, logprobs) in runs["unrolled"].items():
        assert runs["scan"][slot][0] == tokens, slot
        np.testing.assert_allclose(runs["scan"][slot][1], logprobs, atol=1e-4)


def test_an_encoder_decoder_refuses_the_scan():
    from metrale_jax.engine.placement import place_params
    cfg = SimpleNamespace(is_encoder_decoder=True, quantization=None)
    with pytest.raises(InvalidParameterError, match="layer_loop"):
        place_params(cfg, None, {}, EngineConfig(layer_loop="scan"), None)


def test_speculative_verify_in_scanned_form_gives_the_decode_tokens():
    """Verify steps (`engine/speculative.py`) run the scanned layers too: the tokens of
    decode steps, with drafts accepted."""
    from tests.engine.test_speculative import K, _decode, _speculate
    graphdef, params = nnx.split(Transformer(TINY, rngs=nnx.Rngs(0)))
    params = jax.tree.map(lambda x: x * 10.0 if x.ndim > 1 else x, params)
    engine = make_engine(TINY, graphdef, params, layer_loop="scan", speculative_tokens=K)
    reference = _decode(engine, SlotSettings())
    tokens, accepted = _speculate(engine, SlotSettings(), reference)
    assert tokens == reference
    assert accepted >= 10


def test_the_cli_flag_sets_the_engine_setting():
    import argparse

    from serving.cli.scale import add_scale_flags, engine_options
    parser = argparse.ArgumentParser()
    add_scale_flags(parser, processes=False)
    assert engine_options(parser.parse_args(["--layer-loop", "scan"]))["layer_loop"] == "scan"
    assert "layer_loop" not in engine_options(parser.parse_args([]))
    with pytest.raises(SystemExit):
        parser.parse_args(["--layer-loop", "rolled"])


def test_llava_language_model_runs_scanned(tmp_path):
    """A tiny LLaVA's language model in scanned form: transformers' greedy tokens for a
    prompt with an image (`tests/scheduler/test_vision.py`'s check, one image)."""
    from devtools.llava_models import build_llava_folder
    from metrale_jax import LLM
    from tests.scheduler.test_vision import _prompt, _reference, _run
    hf = build_llava_folder(tmp_path, "clip", "llama")
    llm = LLM(tmp_path, max_slots=4, max_len=128, max_prefill_len=16, max_prefill_batch=2,
              max_images=3, layer_loop="scan")
    try:
        assert isinstance(llm.scheduler.engine.params, StackedLayerParams)
        ids, images, pixels = _prompt(llm, 1, "What is in the picture?", seed=1)
        handle, collect = _run(llm, ids, images)
        want, _ = _reference(hf, ids, pixels)
        assert list(collect(handle).token_ids) == want
    finally:
        llm.close()
