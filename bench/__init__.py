"""Benchmarks, one script per question (`python bench/engine.py --help`), with what several
share beside them (`engine_common`, `paged_server`, `tables`). May import metrale_jax, serving
and devtools (the tiny random models tests use too); never tests.
"""

# The project packages this package's modules may import besides its own (tests/test_imports.py).
MAY_IMPORT = ("devtools", "metrale_jax", "serving")
