"""Mixture-of-experts models (Qwen3-MoE, Mixtral) through the ragged paged engine: greedy
tokens equal to transformers' over 48 steps (prompts shorter and longer than a page, one
chunked), batch invariance, the compile counter flat after warmup, the scanned layer loop."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from devtools.hf_models import build_hf_model
from metrale_jax.weights.assemble import assemble_params
from metrale_jax.weights.hf_config import read_hf_config
from metrale_jax.weights.safetensors_reader import read_safetensors
from tests.engine.conftest import make_engine
from tests.engine.test_engine import check_batch_invariance_and_seeds
from tests.engine.test_greedy_hf import NEW_TOKENS, PROMPT_LENGTHS, run_engine

# One chunk bucket (32, the largest: the 45-token prompt and two of `mixed_items` still go in
# two chunks): warmup compiles the grid's steps without the 16-token chunks, which run the same
# expert routing in a shorter chunk.
ONE_BUCKET = dict(min_prefill_bucket=32)


def hf_greedy(hf, prompt: list[int]) -> list[int]:
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=NEW_TOKENS,
                          eos_token_id=None, pad_token_id=0)
    return ref[0, len(prompt):].tolist()


@pytest.mark.parametrize(("arch", "loop"), [("qwen3_moe", "unrolled"), ("mixtral", "scan")])
def test_moe_engine_matches_transformers(arch, loop, tmp_path):
    hf = build_hf_model(arch, tmp_path)
    hf.generation_config.eos_token_id = None
    cfg = read_hf_config(tmp_path)
    assert cfg.is_moe
    graphdef, params = assemble_params(cfg, read_safetensors(tmp_path), tmp_path)
    engine = make_engine(cfg, graphdef, params, layer_loop=loop, **ONE_BUCKET)
    engine.warmup()
    compiled = engine.compile_count
    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in PROMPT_LENGTHS]
    ours = run_engine(engine, prompts, NEW_TOKENS)
    for prompt, got in zip(prompts, ours, strict=True):
        assert got == hf_greedy(hf, prompt), f"{arch}, prompt of {len(prompt)} tokens"
    check_batch_invariance_and_seeds(engine)
    assert engine.compile_count == compiled


def test_lora_on_a_moe_model_is_refused():
    from flax import nnx

    from metrale_jax.config import ModelConfig
    from metrale_jax.errors import InvalidParameterError
    from metrale_jax.models.transformer import Transformer

    cfg = ModelConfig("mixtral", vocab_size=64, hidden_size=32, intermediate_size=32,
                      num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16, num_experts=4,
                      experts_per_token=2, moe_intermediate_size=32, norm_topk_prob=True)
    graphdef, params = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))
    with pytest.raises(InvalidParameterError, match="mixture-of-experts") as err:
        make_engine(cfg, graphdef, params, max_loras=2)
    assert err.value.status == 400


def test_router_counts_add_up_to_the_routed_tokens(tmp_path):
    """Every real token (prompt and decoded) counted once per layer for each of its k
    experts; padding and idle rows not at all; a dense engine has none."""
    from flax import nnx

    from metrale_jax.config import ModelConfig
    from metrale_jax.engine import SlotSettings
    from metrale_jax.models.transformer import Transformer

    cfg = ModelConfig("qwen3_moe", vocab_size=128, hidden_size=32, intermediate_size=32,
                      num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16, qk_norm=True,
                      num_experts=4, experts_per_token=2, moe_intermediate_size=32)
    graphdef, params = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))
    engine = make_engine(cfg, graphdef, params, max_slots=4, decode_steps=2)
    assert engine.router_counts().shape == (2, 4) and not engine.router_counts().any()
    state = engine.init_decode_state()
    state, _ = engine.add(state, [(0, list(range(20)), SlotSettings()),
                                  (2, list(range(5)), SlotSettings())])
    prompt_tokens = 25
    assert (engine.router_counts().sum(axis=1) == 2 * prompt_tokens).all()
    active = np.array([True, False, True, False])
    for _ in range(3):
        state, _ = engine.step(state, active)  # decode_steps=2 tokens for 2 rows each
    counts = engine.router_counts()
    assert (counts.sum(axis=1) == 2 * (prompt_tokens + 3 * 2 * 2)).all()


def test_int8_experts_through_the_engine(tmp_path):
    """An int8 MoE engine's greedy tokens are the argmax of the int8 model's own logits
    (teacher-forced through `sequence_logits`), the compile count flat."""
    from devtools.logits import stacked_logits
    from metrale_jax.models.quantized_model import quantize_state

    build_hf_model("mixtral", tmp_path)
    cfg = read_hf_config(tmp_path)
    graphdef, params = assemble_params(cfg, read_safetensors(tmp_path), tmp_path)
    engine = make_engine(cfg, graphdef, params, quantization="int8", max_slots=1,
                         max_prefill_batch=1, **ONE_BUCKET)  # one prompt: one slot
    engine.warmup()
    compiled = engine.compile_count
    prompt = np.random.default_rng(3).integers(0, cfg.vocab_size, 20).tolist()
    got = run_engine(engine, [prompt], 8)[0]
    _, qgraph, qparams = quantize_state(cfg, params, "int8")
    logits = stacked_logits(qgraph, qparams, np.asarray([prompt + got[:-1]]))[0]
    assert logits[len(prompt) - 1:].argmax(-1).tolist() == got
    assert engine.compile_count == compiled
