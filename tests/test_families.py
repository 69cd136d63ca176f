"""The model families' table (`metrale_jax.families`): every family module registered once,
its names and switches reaching the `ModelConfig` the readers build, and a test model for each
decoder family (so a new family is fidelity-tested against transformers)."""

from __future__ import annotations

import importlib
import pkgutil
from pathlib import Path

import pytest

from devtools.hf_models import ARCH_CONFIGS, COMMON
from metrale_jax import families
from metrale_jax.config import ModelConfig
from metrale_jax.errors import CheckpointError, UnsupportedModelError
from metrale_jax.families import REGISTRY, family_of_config, family_of_gguf, family_of_hf, llava
from metrale_jax.families.m2m100 import M2M100Config
from metrale_jax.weights.gguf_names import hf_name
from metrale_jax.weights.hf_config import llava_model_config, model_config_from_hf

PATH = Path("config.json")
DECODERS = sorted(name for name, f in REGISTRY.items() if f.kind == "decoder")
SHARED = ("family", "registry")  # the package's own modules, not families


def test_every_family_module_is_registered_once():
    """Each module of the package (but `family` and `registry`) declares a `FAMILY` that the
    registry holds, under its own name; no HF or GGUF name belongs to two families."""
    modules = [m.name for m in pkgutil.iter_modules(families.__path__) if m.name not in SHARED]
    declared = [importlib.import_module(f"metrale_jax.families.{m}").FAMILY for m in modules]
    assert sorted(f.name for f in declared) == sorted(REGISTRY)
    assert all(REGISTRY[f.name] is f for f in declared)
    for family in REGISTRY.values():
        assert all(family_of_hf(t) is family for t in family.hf_model_types)
        assert all(family_of_gguf(a) is family for a in family.gguf_architectures)


def test_architectures_derive_from_the_registry():
    """`ModelConfig.architecture` takes a family's name, never a vision-language wrapper's."""
    derived = tuple(name for name, family in REGISTRY.items()
                    if family.kind != "vision_language")
    assert derived == families.ARCHITECTURES
    assert {"llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "m2m_100"} <= \
        set(families.ARCHITECTURES)
    assert "llava" not in families.ARCHITECTURES
    shape = dict(vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=1, num_heads=1,
                 num_kv_heads=1, head_dim=8)
    for name in ("llava", "falcon"):
        with pytest.raises(CheckpointError, match="unknown architecture"):
            ModelConfig(name, **shape)


def test_every_decoder_family_has_a_test_model():
    """devtools/hf_models.py builds a tiny transformers model of each decoder family: the
    fidelity, greedy and reader tests then cover it."""
    assert set(DECODERS) <= set(ARCH_CONFIGS)


@pytest.mark.parametrize("arch", sorted(ARCH_CONFIGS))
def test_config_json_reads_as_its_family(arch):
    """transformers' own config of each test model reads as its family: the family's graph
    switches set, its cache kinds honoured."""
    config_cls, _, extra = ARCH_CONFIGS[arch]
    cfg = model_config_from_hf(config_cls(**{**COMMON, **extra}).to_dict(), PATH)
    family = family_of_config(cfg.architecture)
    assert family is family_of_hf(config_cls.model_type)
    assert all(getattr(cfg, k) == v for k, v in family.graph.items())
    assert "full" in family.cache
    if cfg.sliding_window is not None:
        assert "sliding" in family.cache


def test_gguf_tensor_names_follow_the_family():
    """Gemma 2 declares its four norms; the others share Llama's names."""
    assert hf_name("blk.1.ffn_norm.weight", "gemma2") == \
        "model.layers.1.pre_feedforward_layernorm.weight"
    assert hf_name("blk.1.ffn_norm.weight", "llama") == \
        "model.layers.1.post_attention_layernorm.weight"
    assert hf_name("blk.0.post_ffw_norm.weight", "qwen2") is None


def test_wrapper_and_encoder_decoder_families():
    """LLaVA reads its text model with that model's family (Llama when unnamed) and adds
    `vision`; M2M100's config is an encoder-decoder with cross-attention; neither is a
    decoder-only `config.json`."""
    text = {**COMMON, "vocab_size": 40000}
    cfg = llava_model_config({"model_type": "llava", "text_config": text}, PATH)
    assert cfg.architecture == llava.TEXT_MODEL_TYPE and cfg.vision is not None
    m2m = M2M100Config(vocab_size=64, d_model=16, encoder_layers=1, decoder_layers=2,
                       encoder_attention_heads=2, decoder_attention_heads=2,
                       encoder_ffn_dim=32, decoder_ffn_dim=32)
    family = family_of_config(ModelConfig.for_m2m100(m2m).architecture)
    assert family.kind == "encoder_decoder" and "cross" in family.cache
    for model_type in ("llava", "m2m_100"):
        with pytest.raises(UnsupportedModelError, match="supported: gemma, gemma2, .*llama"):
            model_config_from_hf({**COMMON, "model_type": model_type}, PATH)
