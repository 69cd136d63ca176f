"""A tiny random Llama with a real tokenizer, loaded once per test session as an `LLM`."""

from __future__ import annotations

import pytest

from devtools.hf_models import build_tiny_checkpoint


@pytest.fixture(scope="session")
def tiny_folder(tmp_path_factory):
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_llm(tiny_folder):
    from metrale_jax import LLM
    llm = LLM(tiny_folder, max_slots=4, max_len=128, max_prefill_len=32, max_prefill_batch=2)
    _ = llm.scheduler  # compile once for the session
    yield llm
    llm.close()


@pytest.fixture(scope="session")
def small_pool_llm(tiny_folder):
    """The tiny model with a pool of 7 usable pages of 16 positions (112 tokens, less than
    max_len): too few for four sequences of 45-90 tokens at once."""
    from metrale_jax import LLM
    llm = LLM(tiny_folder, max_slots=4, max_len=128, max_prefill_len=32, max_prefill_batch=2,
              num_pages=8)
    _ = llm.scheduler
    yield llm
    llm.close()
