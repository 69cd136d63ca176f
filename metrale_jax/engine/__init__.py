"""Device side: every jit-compiled program lives here (see engine/engine.py).

May import models, config, errors and sampling_fields (the table of request settings that
`SlotSettings` and `SamplingState` derive from); never scheduler, text or weights (a
checkpoint's placement reaches the loader as a callable).
"""

from metrale_jax.engine.config import EngineConfig
from metrale_jax.engine.engine import Engine, OutOfPagesError, Piece
from metrale_jax.engine.sampling import SamplingState
from metrale_jax.engine.state import DecodeState, SlotSettings, StepOutput

__all__ = ["DecodeState", "Engine", "EngineConfig", "OutOfPagesError", "Piece", "SamplingState",
           "SlotSettings", "StepOutput"]
