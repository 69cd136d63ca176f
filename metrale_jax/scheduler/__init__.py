"""Host side: requests, slots, the batching loop thread, detokenizing and stops.

`Scheduler` (scheduler.py) runs the loop and owns its parts: request validation
(validation.py), the LoRA registry (lora_registry.py), the rows (rows.py), chunk planning
(chunks.py), the steps in flight (steps.py), beam rows (beam_rows.py, over beam.py's search),
speculation (speculation.py) and grammar masks (grammar_slots.py).

May import engine, text, config and errors; never weights (it is handed a loaded engine).
"""

from metrale_jax.scheduler.events import (
    Cancelled,
    Event,
    Failed,
    Finished,
    Pooled,
    TimedOut,
    Token,
    TokenLogprob,
)
from metrale_jax.scheduler.request import GenerationRequest, RequestHandle
from metrale_jax.scheduler.sampling_params import SamplingParams
from metrale_jax.scheduler.scheduler import Scheduler

__all__ = [
    "Cancelled",
    "Event",
    "Failed",
    "Finished",
    "GenerationRequest",
    "Pooled",
    "RequestHandle",
    "SamplingParams",
    "Scheduler",
    "TimedOut",
    "Token",
    "TokenLogprob",
]

# The project packages this package's modules may import besides its own (tests/test_imports.py).
MAY_IMPORT = ("metrale_jax.config", "metrale_jax.engine", "metrale_jax.errors",
               "metrale_jax.sampling_fields", "metrale_jax.text")
