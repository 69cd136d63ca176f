"""Device side: every jit-compiled program lives here (see engine/engine.py: `Engine` and the
parts it owns: programs, pieces, lora_slots, source_encoder, image_encoder, beam_forks).

May import models, config, errors, sampling_fields (the table of request settings that
`SlotSettings` and `SamplingState` derive from) and vision (a prompt's `PromptImage` records);
never scheduler, text or weights (a checkpoint's placement reaches the loader as a callable).
"""

from metrale_jax.engine.config import EngineConfig
from metrale_jax.engine.engine import Engine
from metrale_jax.engine.pieces import OutOfPagesError, Piece, plan_pieces
from metrale_jax.engine.sampling import SamplingState
from metrale_jax.engine.state import DecodeState, SlotSettings, StepOutput

__all__ = ["DecodeState", "Engine", "EngineConfig", "OutOfPagesError", "Piece", "SamplingState",
           "SlotSettings", "StepOutput", "plan_pieces"]

# The project packages this package's modules may import besides its own (tests/test_imports.py).
MAY_IMPORT = ("metrale_jax.config", "metrale_jax.errors", "metrale_jax.host_memory",
              "metrale_jax.kernels", "metrale_jax.models", "metrale_jax.sampling_fields",
              "metrale_jax.vision")
