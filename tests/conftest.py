"""Shared test setup: one OpenMP thread per test process, JAX's persistent compilation
cache, and the default-model fixture."""

from __future__ import annotations

import os
from pathlib import Path

# `make test` runs two xdist workers on a 2-core machine, and the subprocesses of the mesh,
# multi-host and notebook tests share those cores too. torch's OpenMP threads spin while
# they wait for work, so with one thread per core in every process the transformers
# references slowed down about 11x (test_default_model_greedy: 27 s alone, 430 s beside the
# notebooks; 39 s with one thread). Set before torch is imported; inherited by subprocesses.
os.environ["OMP_NUM_THREADS"] = "1"

import jax
import pytest

REPO = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("METRALE_TEST_JAX_CACHE", REPO / ".jax_cache" / "tests"))
CACHE.mkdir(parents=True, exist_ok=True)
jax.config.update("jax_compilation_cache_dir", str(CACHE))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


@pytest.fixture(scope="session")
def default_gguf() -> Path:
    """The default model's GGUF (fetched by `make test` via `metrale pull`)."""
    from metrale_jax.weights.default_model import default_model_path
    path = default_model_path()
    if not path.is_file():
        pytest.skip(f"default model not in {path}; run `metrale pull`")
    return path
