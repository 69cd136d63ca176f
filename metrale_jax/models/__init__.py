"""Flax NNX model definitions: pure (params, tokens, positions, cache) -> (logits, cache).
May import families, config and errors only.
"""
