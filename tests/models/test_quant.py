"""int8 weight-only quantization (`metrale_jax/models/quant.py`): the round trip bound, the
logits of every architecture against float32, greedy decoding through the engine, the
orbax round trip and GGUF Q8_0 tensors.

Tolerances come from the quantization error, not from a run:
- per element, `|w - q * scale| <= scale / 2` (round to nearest), so every weight is off by
  at most 1/254 of its channel's largest magnitude;
- the int8 forward equals the float forward run on the dequantized weights `q * scale` up to
  float32 rounding (the scale applied after the dot instead of inside it): 1e-5 of the
  logits' range;
- against the float32 model: each of the `4 L` products on a token's path (q/k/v, o, gate/up,
  down per layer; +1 for a quantized head) adds to first order at most its weights' relative
  error, 1/254, of the logits' scale, so `max |logits_int8 - logits_f32| <= (4 L + 1) / 254 *
  max |logits_f32|`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from devtools.logits import stacked_logits
from metrale_jax.config import ModelConfig
from metrale_jax.models.quant import (
    SCALE_SUFFIX,
    dequantize,
    quantize,
    stacked_in_axes,
)
from metrale_jax.models.quantized_model import quantize_state
from metrale_jax.models.transformer import Transformer

TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
            num_kv_heads=2, head_dim=16)
GEMMA = dict(norm_weight_offset=True, embed_scale=True, hidden_act="gelu_tanh",
             tie_word_embeddings=True)
ARCHS = {
    "llama": dict(architecture="llama"),
    "mistral": dict(architecture="mistral", sliding_window=4),
    "qwen2": dict(architecture="qwen2", attention_bias=True),
    "qwen3": dict(architecture="qwen3", qk_norm=True, tie_word_embeddings=True),
    "gemma": dict(architecture="gemma", **GEMMA),
    "gemma2": dict(architecture="gemma2", **GEMMA, post_norms=True, attn_logit_softcap=20.0,
                   final_logit_softcap=15.0, sliding_window=4, sliding_layers=(True, False),
                   query_pre_attn_scalar=16.0),
    "gemma3": dict(architecture="gemma3", **GEMMA, post_norms=True, qk_norm=True,
                   sliding_window=4, sliding_layers=(True, False), query_pre_attn_scalar=16.0,
                   rope_theta=1e6, rope_local_theta=1e4),
}
LAYOUTS = {  # weight shape, input axes -> scale shape (the output axes)
    "q_proj [E, H, D]": ((64, 4, 16), (0,), (4, 16)),
    "o_proj [H, D, E]": ((4, 16, 64), (0, 1), (64,)),
    "gate [E, F]": ((64, 128), (0,), (128,)),
    "down [F, E]": ((128, 64), (0,), (64,)),
    "embed [V, E]": ((256, 64), (1,), (256,)),
    "stacked q_proj [L, E, H, D]": ((2, 64, 4, 16), (1,), (2, 4, 16)),
}
TOKENS = 12


def random_model(arch: str, seed: int = 0) -> tuple[ModelConfig, nnx.GraphDef, nnx.State]:
    """A tiny float32 model of `arch`: the init's small weights (std 0.02: each block a small
    update of the residual stream, as in trained models) and random norm weights."""
    cfg = ModelConfig(**{**TINY, **ARCHS[arch]})
    graphdef, params = nnx.split(Transformer(cfg, rngs=nnx.Rngs(seed)))
    rng = np.random.default_rng(seed)
    params = jax.tree.map(
        lambda x: x if x.ndim > 1 else x + 0.1 * rng.standard_normal(x.shape, np.float32),
        params)
    return cfg, graphdef, params


def dequantized(cfg: ModelConfig, qparams: nnx.State) -> dict:
    """The float params `q * scale` of a quantized model, as a pure dict of the float model."""
    pure = nnx.to_pure_dict(qparams)

    def walk(tree: dict, path: tuple[str, ...]) -> dict:
        out = {}
        for key, value in tree.items():
            if isinstance(value, dict):
                out[key] = walk(value, (*path, key))
            elif key.endswith(SCALE_SUFFIX):
                continue
            elif value.dtype == jnp.int8:
                out[key] = jnp.asarray(dequantize(np.asarray(value),
                                                  np.asarray(tree[key + SCALE_SUFFIX]),
                                                  stacked_in_axes((*path, key))))
            else:
                out[key] = value
        return out
    return walk(pure, ())


# ---- the representation -------------------------------------------------------------------
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_round_trip_within_half_a_step(layout):
    shape, in_axes, scale_shape = LAYOUTS[layout]
    rng = np.random.default_rng(0)
    w = rng.standard_normal(shape).astype(np.float32) * rng.uniform(0.01, 3.0, shape[-1])
    w[..., 0] = 0.0  # a channel of zeros (scale 0) stays exact
    q, scale = quantize(w, in_axes)
    assert q.dtype == np.int8 and q.shape == w.shape and scale.shape == scale_shape
    assert np.abs(q.astype(np.int32)).max() <= 127
    err = np.abs(w - dequantize(q, scale, in_axes))
    bound = np.expand_dims(scale, in_axes) / 2
    assert np.all(err <= bound * (1 + 1e-6) + 1e-30), float((err - bound).max())
    # every channel reaches +-127: the scale uses the whole int8 range
    assert np.all(np.abs(q).max(axis=in_axes)[..., 1:] == 127)
    qj, sj = quantize(jnp.asarray(w), in_axes)  # the jax path (model init) agrees to 1 ulp
    np.testing.assert_array_equal(np.asarray(qj), q)
    np.testing.assert_allclose(np.asarray(sj), scale, rtol=3e-7)  # 1 ulp


# ---- logits per architecture --------------------------------------------------------------
@pytest.mark.parametrize("arch", list(ARCHS))
def test_logits_within_the_quantization_bound(arch):
    cfg, graphdef, params = random_model(arch)
    mode = "int8-all" if arch in ("llama", "gemma") else "int8"  # untied and tied heads
    qcfg, qgraph, qparams = quantize_state(cfg, params, mode)
    assert qcfg.quantization == mode
    pure = nnx.to_pure_dict(qparams)
    assert pure["blocks"]["attn"]["o_proj"].dtype == jnp.int8
    assert pure["blocks"]["attn"]["o_proj_scale"].shape == (cfg.num_layers, cfg.hidden_size)
    assert (pure["embed"].dtype == jnp.int8) == (mode == "int8-all")
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, cfg.vocab_size, (1, TOKENS)),
                         jnp.int32)
    ref = stacked_logits(graphdef, params, tokens)
    got = stacked_logits(qgraph, qparams, tokens)
    deq = jax.tree.map(lambda x: x, params)
    nnx.replace_by_pure_dict(deq, dequantized(qcfg, qparams))
    same = stacked_logits(graphdef, deq, tokens)
    scale = np.abs(ref).max()
    # the int8 path computes the float model of the dequantized weights
    assert np.abs(got - same).max() <= 1e-5 * scale
    # and stays within the first-order bound of the float32 model
    products = 4 * cfg.num_layers + (mode == "int8-all")
    rel = np.abs(got - ref).max() / scale
    print(arch, mode, "max rel logit error", rel, "bound", products / 254)
    assert rel <= products / 254, (rel, products / 254)


# ---- through the engine ---------------------------------------------------------------------
@pytest.mark.accelerator
def test_engine_quantizes_a_float_model_and_decodes_greedily():
    from metrale_jax.engine import Engine, EngineConfig, SlotSettings
    from tests.conftest import CACHE
    cfg, graphdef, params = random_model("llama")
    engine = Engine(cfg, graphdef, params, EngineConfig(
        max_slots=2, max_len=64, min_prefill_bucket=16, max_prefill_len=16,
        num_top_logprobs=1, quantization="int8", compilation_cache_dir=str(CACHE)))
    assert engine.model_config.quantization == "int8"
    layer = engine.params.layers[0]
    assert layer["mlp"]["down"][...].dtype == jnp.int8
    assert layer["mlp"]["down_scale"][...].shape == (cfg.hidden_size,)
    prompt = np.random.default_rng(2).integers(0, cfg.vocab_size, 7).tolist()
    state = engine.init_decode_state()
    state, first = engine.add(state, [(0, prompt, SlotSettings())])
    out = [int(np.asarray(first.tokens)[0, 0])]
    active = np.arange(engine.config.max_slots) < 1
    for _ in range(6):
        state, step = engine.step(state, active)
        out.append(int(np.asarray(step.tokens)[0, 0]))
    # teacher-forced: the quantized model's own argmax at every position of prompt + output
    _, qgraph, qparams = quantize_state(cfg, params, "int8")
    logits = stacked_logits(qgraph, qparams, [prompt + out[:-1]])
    assert logits[0, len(prompt) - 1:].argmax(-1).tolist() == out


# ---- checkpoints (the orbax round trip: tests/serving/cli/test_quantization.py) -----------
def load_quantized_gguf(tmp_path, tensor_type, quantization: str):
    """A tiny llama GGUF of `tensor_type` tensors (tests/weights/test_gguf_reader.py's),
    loaded with `quantization`: (its spec, the file's exact float values by HF name, the
    params as a pure dict)."""
    from metrale_jax.weights.assemble import assemble_params
    from metrale_jax.weights.gguf_reader import read_gguf
    from tests.weights.test_gguf_reader import make
    path, spec, _, exact, _ = make(tmp_path, "llama", types=tensor_type)
    cfg, tensors, _ = read_gguf(path)
    _, params = assemble_params(dataclasses.replace(cfg, quantization=quantization), tensors,
                                path)
    return spec, exact, nnx.to_pure_dict(params)


def test_gguf_q8_0_tensors_become_int8_per_channel(tmp_path):
    """Q8_0 blocks (32 inputs, one float16 scale each) are requantized per output channel:
    the int8 weight is within half a per-channel step of the file's own values."""
    from gguf import GGMLQuantizationType as Q

    spec, exact, pure = load_quantized_gguf(tmp_path, Q.Q8_0, "int8")
    q, scale = pure["blocks"]["mlp"]["down"], pure["blocks"]["mlp"]["down_scale"]
    assert q.dtype == jnp.int8
    want = np.stack([exact[f"model.layers.{i}.mlp.down_proj.weight"].T for i in range(spec.L)])
    got = dequantize(np.asarray(q), np.asarray(scale), (1,))
    assert np.all(np.abs(got - want) <= np.asarray(scale)[:, None] / 2 * (1 + 1e-6))
