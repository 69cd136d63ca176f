"""Checkpoint readers (Hugging Face safetensors folders, GGUF, Metrale's orbax format) that
load a model into a `Checkpoint` (loaded.py): config, stacked params, tokenizer, template.
May import models, text, families, config and errors; never engine or scheduler.
"""

# The project packages this package's modules may import besides its own (tests/test_imports.py).
MAY_IMPORT = ("metrale_jax.config", "metrale_jax.errors", "metrale_jax.models",
               "metrale_jax.text", "metrale_jax.families")
