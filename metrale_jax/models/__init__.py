"""Flax NNX model definitions: pure (params, tokens, positions, cache) -> (logits, cache).
May import config (with the M2M100 and vision configs), errors and kernels (the CPU
products of the quantized linears) only.
"""

# The project packages this package's modules may import besides its own (tests/test_imports.py).
MAY_IMPORT = ("metrale_jax.config", "metrale_jax.errors", "metrale_jax.kernels",
               "metrale_jax.m2m100_config", "metrale_jax.vision_config")
