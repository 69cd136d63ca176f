"""Flax NNX model definitions (`transformer.py`, `m2m100.py`, `vision.py`: the params and their
logical axes) and the pure ragged steps the engine compiles over them: `ragged.py` (decoder-only,
params split per layer by `unrolled.py`, or stacked for one loop over the layers by
`scanned.py`) and `seq2seq_ragged.py` (encoder-decoder), both over paged caches
(`paged_attention.py`); the mixture-of-experts MLP (`moe.py`); quantized linears (`quant*.py`)
and LoRA (`lora.py`).
May import families, config, errors and kernels (the CPU products of the quantized linears) only.
"""

# The project packages this package's modules may import besides its own (tests/test_imports.py).
MAY_IMPORT = ("metrale_jax.config", "metrale_jax.errors", "metrale_jax.kernels",
               "metrale_jax.families")
