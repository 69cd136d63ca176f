"""A vision-language model's vision encoder on the engine side: the programs that write a
prompt's image features into the pool, and the checks on a request's images.

The pool's host bookkeeping (which slot holds which row's images) is `images.ImagePool`;
`encode` gives each image of a step's pieces that its row does not hold yet a slot and runs
the vision encoder over them in image buckets (`EngineConfig.image_buckets`) before the step.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from metrale_jax.config import ModelConfig
from metrale_jax.engine import steps
from metrale_jax.engine.config import EngineConfig
from metrale_jax.engine.images import ImagePool
from metrale_jax.engine.pieces import Piece
from metrale_jax.engine.placement import StepShardings
from metrale_jax.engine.programs import Job, ProgramCache, abstract, spec
from metrale_jax.engine.state import DecodeState
from metrale_jax.errors import InvalidParameterError


def check_images(count: int, model_config: ModelConfig, max_images: int) -> None:
    """Raises unless a request may send `count` images (a vision-language model's pool holds
    `max_images`; a text-only model, `model_config.vision` None, takes none)."""
    if count and model_config.vision is None:
        raise InvalidParameterError("this model takes no images: it is a text-only "
                                    "model", param="messages")
    if count > max_images:
        raise InvalidParameterError(
            f"{count} images in one request; this server takes at most "
            f"{max_images} (--max-images)", param="messages")


class ImageEncoder:
    """The vision encoder's programs and the image pool.

    model_config: a vision-language model's (its `vision` config); graphdef, params: its
    vision encoder (`models/vision.py`), cast to the engine's dtype and replicated here;
    state_spec: the abstract `DecodeState`. Attributes: pool (`ImagePool`), params (on the
    devices)."""

    def __init__(self, config: EngineConfig, model_config: ModelConfig, graphdef: Any,
                 params: Any, cache: ProgramCache, shardings: StepShardings,
                 state_spec: DecodeState):
        vision = model_config.vision
        self.config, self.vision, self.graphdef = config, vision, graphdef
        self.cache, self.shardings, self.state_spec = cache, shardings, state_spec
        self.pool = ImagePool(config.max_images, vision.tokens_per_image)
        dtype = jnp.dtype(config.dtype)
        self.params = jax.device_put(jax.tree.map(lambda x: jnp.asarray(x, dtype), params),
                                     shardings.replicated)

    def program(self, N: int) -> Any:
        """The vision encoder over N images `[N, C, H, W] float32`, writing their features
        into the pool slots `[N] int32` (max_images: none)."""
        v = self.vision
        fn = jax.jit(functools.partial(steps.encode_images, self.graphdef),
                     donate_argnums=(1,), out_shardings=self.shardings.state)
        return self.cache.compile(("vision", N), fn, abstract(self.params), self.state_spec,
                                  spec((N, v.num_channels, v.image_size, v.image_size),
                                       jnp.float32),
                                  spec((N,), jnp.int32))

    def jobs(self) -> list[Job]:
        """The warmup jobs: the encoder per image bucket."""
        return [functools.partial(self.program, N) for N in self.config.image_buckets]

    def encode(self, state: DecodeState, pieces: Sequence[Piece]) -> DecodeState:
        """Runs the vision encoder over the pieces' images that their rows do not hold yet
        (each given a pool slot), in image buckets; state donated."""
        todo = []
        for p in pieces:
            for im in self.pool.missing(p.slot, p.images):
                todo.append((self.pool.assign(p.slot, im), im))
        buckets = self.config.image_buckets
        v = self.vision
        while todo:
            N = next((b for b in buckets if len(todo) <= b), buckets[-1])
            group, todo = todo[:N], todo[N:]
            pixels = np.zeros((N, v.num_channels, v.image_size, v.image_size), np.float32)
            dst = np.full(N, self.config.max_images, np.int32)
            for i, (slot, im) in enumerate(group):
                pixels[i], dst[i] = im.pixels, slot
            state = self.program(N)(self.params, state, pixels, dst)
        return state
