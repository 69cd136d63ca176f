"""Hand-written XLA FFI kernels for XLA:CPU, compiled from C++ on first use.

- `build.py`: compile a .cc of this package with the system g++ into a per-user cache.
- `int8_matmul.py`: `(x @ q) * scale` for int8 weights (`models/quant.py` calls it on CPU).
- `int4_matmul.py`: `x @ w^T` for int4 weights in Q4_1 blocks (`models/quant4.py`).
- `decode_attention.py`: paged decode attention over float or int8 pages.
- `chunk_attention.py`: a prefill chunk's attention to its pieces' paged context and itself.
Imports nothing of the project (models/ imports it).
"""

# The project packages this package's modules may import besides its own (tests/test_imports.py).
MAY_IMPORT = ()
