"""RoPE scalings (`RopeScaling`, `models/layers.rope_inverse_frequencies`) and Phi-3 against
transformers 5 in float32.

- the inverse frequencies and attention factor of every `rope_type` equal transformers'
  `ROPE_INIT_FUNCTIONS` (dynamic at `factor` x the model's positions, longrope's short and
  long factors at the lengths transformers picks each);
- logits of the scalings transformers re-derives per sequence length (dynamic, LongRoPE past
  `original_max_position_embeddings`) equal where the two agree, for prompts shorter and
  longer than a page; greedy tokens equal over 48 steps through the paged engine;
- Phi-3 written as llama.cpp's converter writes it (fused `attn_qkv` / `ffn_up`, LongRoPE
  factor tensors, partial rotary) loads to the HF folder's logits;
- configs: both config.json forms, Phi-3's aliases, unknown types refused, dict round trips.
"""

from __future__ import annotations

import dataclasses
import json

import gguf
import numpy as np
import pytest
import torch
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from devtools.hf_models import ARCH_CONFIGS, COMMON, ROPE_VARIANTS, build_hf_model
from devtools.logits import stacked_logits
from metrale_jax.config import ModelConfig, RopeScaling
from metrale_jax.errors import CheckpointError, UnsupportedModelError
from metrale_jax.models.layers import rope_attention_factor, rope_inverse_frequencies
from metrale_jax.weights.assemble import assemble_params
from metrale_jax.weights.gguf_reader import read_gguf
from metrale_jax.weights.hf_config import model_config_from_hf, read_hf_config
from metrale_jax.weights.safetensors_reader import read_safetensors
from tests.engine.test_greedy_hf import NEW_TOKENS, run_engine

CONFIGS = {**ARCH_CONFIGS, **ROPE_VARIANTS}


def hf_config(arch: str, **overrides):
    config_cls, _, extra = CONFIGS[arch]
    return config_cls(**{**COMMON, **extra, **overrides})


def ours_of(config) -> ModelConfig:
    return model_config_from_hf(config.to_dict(), "config.json")


# (test model, sequence length transformers computes its table for, our long_context)
TABLES = [("llama3", None, None), ("llama_linear", None, None), ("llama_yarn", None, None),
          ("qwen2_yarn", None, None), ("phi3", None, None), ("llama_dynamic", 48, None),
          ("phi3_long", 25, True), ("phi3_long", 24, False)]


@pytest.mark.parametrize(("arch", "seq_len", "long"), TABLES)
def test_inverse_frequencies_match_transformers(arch, seq_len, long):
    config = hf_config(arch)
    cfg = ours_of(config)
    scaling = cfg.rope_scaling
    if long is not None:
        assert scaling.long_context  # the checkpoint's context exceeds the original one
        scaling = dataclasses.replace(scaling, long_context=long)
    want, attention = ROPE_INIT_FUNCTIONS[scaling.kind](config, "cpu", seq_len=seq_len)
    got = rope_inverse_frequencies(cfg.head_dim, cfg.rope_theta, scaling)
    assert got.shape == tuple(want.shape) and got.dtype == np.float32
    np.testing.assert_allclose(got, want.numpy(), rtol=2e-6, atol=0)
    assert rope_attention_factor(scaling) == pytest.approx(attention, rel=1e-12)


def test_yarn_attention_factor_forms():
    """An explicit attention_factor wins; mscale / mscale_all_dim set it as transformers."""
    for params, want in (({"attention_factor": 0.75}, 0.75),
                         ({"mscale": 1.0, "mscale_all_dim": 0.5}, None)):
        config = hf_config("llama_yarn", rope_scaling={
            "rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32,
            **params})
        _, attention = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
        got = ours_of(config).rope_scaling.attention_factor
        assert got == pytest.approx(attention) == pytest.approx(want or attention)
        assert got != 1.0


def test_both_config_forms_and_phi3_aliases_read_alike():
    """transformers 5 writes `rope_parameters` with `rope_type` and `rope_theta` inside; a
    4.x config.json has `rope_scaling` with `type` and a top-level `rope_theta`."""
    yarn = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    written = hf_config("qwen2_yarn", rope_scaling={**yarn, "rope_theta": 50000.0}).to_dict()
    assert written["rope_parameters"]["rope_type"] == "yarn" and "rope_scaling" not in written
    assert written["rope_parameters"]["rope_theta"] == 50000.0
    legacy = {k: v for k, v in written.items() if k != "rope_parameters"}
    legacy |= {"rope_theta": 50000.0, "rope_scaling": yarn}
    new, old = (model_config_from_hf(d, "config.json") for d in (written, legacy))
    assert new == old and new.rope_theta == 50000.0 and new.rope_scaling.kind == "yarn"
    phi = hf_config("phi3_long").to_dict()
    for alias in ("su", "yarn", "longrope"):
        params = {k: v for k, v in phi["rope_parameters"].items() if k != "rope_type"}
        d = {**phi, "rope_parameters": None, "rope_scaling": {**params, "type": alias}}
        assert model_config_from_hf(d, "config.json") == ours_of(hf_config("phi3_long"))


@pytest.mark.parametrize("kind", ["proportional", "mrope", "ntk-by-parts"])
def test_unknown_rope_type_is_refused_by_name(kind):
    d = {**hf_config("llama").to_dict(), "rope_parameters": {"rope_type": kind, "factor": 2.0}}
    with pytest.raises(UnsupportedModelError, match=f"RoPE scaling type '{kind}'"):
        model_config_from_hf(d, "config.json")
    with pytest.raises(CheckpointError, match=f"'{kind}' is not supported"):
        RopeScaling(kind)  # type: ignore[arg-type]
    saved = ours_of(hf_config("llama_linear")).to_dict()
    with pytest.raises(CheckpointError, match=kind):
        ModelConfig.from_dict({**saved, "rope_scaling": {**saved["rope_scaling"],
                                                         "kind": kind}})


@pytest.mark.parametrize("arch", [a for a, *_ in TABLES[:7]])
def test_each_scaling_round_trips_through_a_dict(arch):
    cfg = ours_of(hf_config(arch))
    assert cfg.rope_scaling is not None
    assert ModelConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg


def test_longrope_factor_lists_must_fit_the_rotated_dimensions():
    saved = ours_of(hf_config("phi3")).to_dict()  # 16 x 0.75 = 12 rotated: 6 frequencies
    rope = {**saved["rope_scaling"], "short_factor": [1.0] * 8, "long_factor": [1.0] * 8}
    with pytest.raises(CheckpointError, match="8 factors per set.*rotate 6"):
        ModelConfig.from_dict({**saved, "rope_scaling": rope})


def test_dicts_saved_before_yarn_and_longrope_still_load():
    base = ours_of(hf_config("llama")).to_dict()
    for kind in ("linear", "llama3"):
        old = {"kind": kind, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
        cfg = ModelConfig.from_dict({**base, "rope_scaling": old})
        assert cfg.rope_scaling == RopeScaling(kind, factor=8.0)
        assert cfg.rope_scaling.attention_factor == 1.0


# ----------------------------------------------------------------------------------------------
# Logits and greedy tokens.

def load(arch: str, folder, overrides: dict | None = None):
    hf = build_hf_model(arch, folder, overrides=overrides)
    cfg = read_hf_config(folder)
    graphdef, params = assemble_params(cfg, read_safetensors(folder), folder)
    return hf, cfg, graphdef, params


def assert_close(ours: np.ndarray, ref: np.ndarray, what: str) -> None:
    err = np.abs(ours - ref).max() / np.abs(ref).max()
    assert err <= 1e-4, f"{what}: max relative logit error {err:.2e}"
    np.testing.assert_array_equal(ours.argmax(-1), ref.argmax(-1))


def hf_logits(hf, ids: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return hf(torch.tensor(ids)).logits.float().numpy()


def test_dynamic_matches_transformers_at_its_scaled_length(tmp_path):
    """transformers' dynamic NTK base at a sequence of `factor` x max_position_embeddings
    (48 tokens: three pages) is the fixed base we use for every position."""
    hf, cfg, graphdef, params = load("llama_dynamic", tmp_path)
    ids = np.random.default_rng(3).integers(0, cfg.vocab_size, size=(2, 48))
    ref = hf_logits(hf, ids)
    assert_close(stacked_logits(graphdef, params, ids), ref, "dynamic, whole")
    assert_close(stacked_logits(graphdef, params, ids[:1], chunk=5, page_size=4), ref[:1],
                 "dynamic, chunked through the cache")


def test_longrope_short_and_long_contexts_match_transformers(tmp_path):
    """Short factors for a 20-token prompt (within original_max_position_embeddings = 24, a
    page and more) when the engine's context stays within it; long factors (the checkpoint's
    default, its context being longer) for a 40-token prompt, as transformers picks them."""
    hf, cfg, graphdef, params = load("phi3_long", tmp_path)
    assert cfg.rope_scaling.long_context and cfg.sliding_window == 40
    rng = np.random.default_rng(5)
    long_ids = rng.integers(0, cfg.vocab_size, size=(1, 40))
    ref = hf_logits(hf, long_ids)
    assert_close(stacked_logits(graphdef, params, long_ids), ref, "long, whole")
    assert_close(stacked_logits(graphdef, params, long_ids, chunk=7, page_size=4), ref,
                 "long, chunked through the cache")
    short = dataclasses.replace(cfg, rope_scaling=dataclasses.replace(cfg.rope_scaling,
                                                                      long_context=False))
    graphdef, params = assemble_params(short, read_safetensors(tmp_path), tmp_path)
    short_ids = rng.integers(0, cfg.vocab_size, size=(2, 20))
    assert_close(stacked_logits(graphdef, params, short_ids), hf_logits(hf, short_ids),
                 "short")


def hf_greedy(hf, prompt: list[int]) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=NEW_TOKENS,
                          eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


GREEDY = [("phi3", (5, 17, 45), None, 128),
          ("phi3_long", (26, 45), None, 128),
          ("phi3_long", (5, 16), {"original_max_position_embeddings": 64}, 64),
          ("llama_dynamic", (9, 30), None, 128),
          ("llama_yarn", (5, 40), None, 128)]


@pytest.mark.parametrize(("arch", "lengths", "overrides", "max_len"), GREEDY)
def test_greedy_through_the_paged_engine_matches_transformers(arch, lengths, overrides,
                                                               max_len, tmp_path):
    """48 greedy tokens of each prompt, all in one engine of `max_len` positions.
    LongRoPE: an engine whose context exceeds original_max_position_embeddings uses the long
    factors, as transformers does for prompts past it; one within it (64 of a checkpoint's
    256) the short ones, as transformers does for every sequence up to it. Dynamic compares
    with transformers' model holding the fixed base of `factor` x its positions (its own
    would change the base as the sequence grows)."""
    from tests.engine.conftest import make_engine

    hf, cfg, graphdef, params = load(arch, tmp_path, overrides)
    hf.generation_config.eos_token_id = None
    if arch == "llama_dynamic":
        rotary = hf.model.rotary_emb
        rotary.rope_type = "default"  # no re-derivation by length
        table = rope_inverse_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        rotary.inv_freq.copy_(torch.from_numpy(table))
    engine = make_engine(cfg, graphdef, params, max_len=max_len)
    if cfg.rope_scaling.kind == "longrope":  # the engine's context picks the factors
        assert cfg.rope_scaling.long_context == (arch == "phi3_long")
        original = cfg.rope_scaling.original_max_position_embeddings
        assert engine.model_config.rope_scaling.long_context == (max_len > original)
    rng = np.random.default_rng(9)
    prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in lengths]
    for prompt, got in zip(prompts, run_engine(engine, prompts, NEW_TOKENS), strict=True):
        assert got == hf_greedy(hf, prompt), f"{arch}, prompt of {len(prompt)} tokens"


# ----------------------------------------------------------------------------------------------
# Phi-3 from GGUF.

def write_phi3_gguf(hf, path) -> None:
    """The tiny model as llama.cpp's Phi3MiniModel converter writes it (float32)."""
    c = hf.config
    rope = c.rope_parameters
    head_dim = c.hidden_size // c.num_attention_heads
    rot = int(head_dim * rope.get("partial_rotary_factor", 1.0))
    original = c.original_max_position_embeddings
    scale = c.max_position_embeddings / original
    attn_factor = rope.get("attention_factor") or (
        float(np.sqrt(1 + np.log(rope["factor"] if rope.get("factor") else scale)
                      / np.log(original))) if (rope.get("factor") or scale) > 1 else 1.0)
    w = gguf.GGUFWriter(str(path), "phi3")
    w.add_context_length(c.max_position_embeddings)
    w.add_rope_scaling_orig_ctx_len(original)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_dimension_count(rot)
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_sliding_window(c.sliding_window or 0)
    w.add_rope_scaling_attn_factors(attn_factor)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"tok{i}" for i in range(c.vocab_size)])
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.PHI3, c.num_hidden_layers)
    for name, tensor in hf.state_dict().items():
        base, suffix = name.rsplit(".", 1)
        w.add_tensor(f"{names.get_name(base)}.{suffix}", tensor.numpy().astype(np.float32))
    for which in ("long", "short"):
        w.add_tensor(f"rope_factors_{which}.weight",
                     np.asarray(rope[f"{which}_factor"], np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("arch", ["phi3", "phi3_long"])
def test_phi3_gguf_loads_to_the_hf_folders_logits(arch, tmp_path):
    hf, cfg, *_ = load(arch, tmp_path / "hf")
    path = tmp_path / "phi3.gguf"
    write_phi3_gguf(hf, path)
    gcfg, tensors, _ = read_gguf(path)
    assert "blk.0.attn_qkv.weight" in [t.name for t in gguf.GGUFReader(path).tensors]
    assert "model.layers.0.self_attn.qkv_proj.weight" in tensors
    assert gcfg.architecture == "phi3" and gcfg.sliding_window == cfg.sliding_window
    assert gcfg.rope_scaling.kind == "longrope"
    for field in ("long_context", "partial_rotary_factor", "original_max_position_embeddings"):
        assert getattr(gcfg.rope_scaling, field) == getattr(cfg.rope_scaling, field), field
    assert gcfg.rope_scaling.attention_factor == pytest.approx(
        cfg.rope_scaling.attention_factor, rel=1e-6)
    ggraph, gparams = assemble_params(gcfg, tensors, path)
    ids = np.random.default_rng(6).integers(0, cfg.vocab_size, size=(1, 40))
    # 40 tokens: within phi3's original context (short factors), past phi3_long's (long).
    assert_close(stacked_logits(ggraph, gparams, ids), hf_logits(hf, ids), f"{arch} from GGUF")
