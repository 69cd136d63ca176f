"""Flax NNX model definitions: pure (params, tokens, positions, cache) -> (logits, cache).
May import config and errors only.
"""
