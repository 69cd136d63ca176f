"""Metrale-JAX: LLM inference on JAX/XLA for TPU, GPU and CPU.

One folder per layer, each importing only those below it: scheduler/ -> engine/ -> models/,
with weights/ and text/ beside; families/ (what each architecture is), config.py and
errors.py below all. Nothing here imports serving (nor Quart or Hypercorn); llm.py, the
offline API, sits on top of them all.
"""

from metrale_jax.errors import MetraleError
from metrale_jax.llm import LLM
from metrale_jax.scheduler import SamplingParams

__all__ = ["LLM", "MetraleError", "SamplingParams"]
__version__ = "0.1.0"

# The project packages this package's modules may import besides its own (tests/test_imports.py).
MAY_IMPORT = ()  # its own modules and packages only (never serving nor bench)
