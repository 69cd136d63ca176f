"""Model families: one module per architecture declares everything Metrale-JAX knows about it.

Each module holds a `FAMILY` (`family.Family`): its HF `model_type`s and GGUF architectures,
its layer graph (the `ModelConfig` switches it sets), how its checkpoint-dependent switches are
read from `config.json` and GGUF metadata, its GGUF tensor names where they differ, and its
cache kinds; `m2m100.py` and `llava.py` also hold the configs of their extra parts
(`M2M100Config`, `VisionConfig`). `registry.py` is the one table of them.

  llama, mistral, qwen2, qwen3, gemma, gemma2,  decoder-only (one layer graph, switches)
  gemma3, phi3
  qwen3_moe, mixtral                            decoder-only, routed experts (models/moe.py)
  m2m100                                        encoder-decoder translation (M2M100, NLLB)
  llava                                         a vision tower before a decoder family

May import errors only (no JAX, no config: `metrale_jax.config` imports this package, so a
family states its reading as plain `ModelConfig` field values). Every layer above may import
it: config, models, engine, weights, text, vision, scheduler, serving. See
docs/add-a-family.md.
"""

from metrale_jax.families.family import CacheKind, Family, GgufMetadata, ModelKind
from metrale_jax.families.registry import (
    ARCHITECTURES,
    REGISTRY,
    family_of_config,
    family_of_gguf,
    family_of_hf,
)

__all__ = ["ARCHITECTURES", "REGISTRY", "CacheKind", "Family", "GgufMetadata", "ModelKind",
           "family_of_config", "family_of_gguf", "family_of_hf"]

# The project packages this package's modules may import besides its own (tests/test_imports.py).
MAY_IMPORT = ("metrale_jax.errors",)
