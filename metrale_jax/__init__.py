"""Metrale-JAX: LLM inference on JAX/XLA for TPU, GPU and CPU."""

from metrale_jax.errors import MetraleError
from metrale_jax.llm import LLM
from metrale_jax.scheduler import SamplingParams

__all__ = ["LLM", "MetraleError", "SamplingParams"]
__version__ = "0.1.0"
