"""Metrale's native checkpoint format: orbax-checkpoint params plus config and tokenizer assets.

Layout of a checkpoint folder:
    metrale.json      format version, ModelConfig, dtype, source, chat template, generation
                      config, and which tokenizer backend the assets are for
    params/           the params pytree (nested dict of arrays) written by orbax
    vision/           a vision-language model's vision encoder params (orbax), if any
    tokenizer/        the tokenizer: HF files (tokenizer.json, tokenizer.model, ...), or
                      `gguf_tokenizer.json` with the GGUF tokenizer metadata

Loading needs neither torch nor transformers, and restores the arrays straight into the
params' shapes and dtype. Given shardings (`load_orbax(path, shardings=...)`, e.g.
`functools.partial(engine.sharding.param_shardings, mesh=mesh)`), orbax restores each array
straight into its sharded `jax.Array` on the mesh: every process reads from disk (or a bucket)
only the slices its own devices hold, and no device or host ever holds a full copy of a
sharded tensor. The stored layout is the same for every mesh (the stacked `[L, ...]` params
of one device), so one checkpoint restores onto any mesh.
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from metrale_jax.config import ModelConfig, check_dtype
from metrale_jax.errors import CheckpointError
from metrale_jax.models.transformer import abstract_model
from metrale_jax.models.vision import abstract_vision
from metrale_jax.text import load_tokenizer, tokenizer_from_gguf_metadata
from metrale_jax.weights.loaded import Checkpoint

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json",
                      "special_tokens_map.json", "added_tokens.json")


def _json_safe(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    return value


def save_orbax(ckpt, dst: Path) -> Path:
    """Writes a loaded `Checkpoint` to `dst` (which must not exist yet); returns `dst`."""
    if ckpt.config.is_encoder_decoder:  # M2M100 / NLLB: its own layout (family "m2m100")
        from metrale_jax.weights.m2m100_reader import save_m2m100_orbax
        tokens = ckpt.path if ckpt.format == "hf" else ckpt.path / "tokenizer"
        return save_m2m100_orbax(nnx.merge(ckpt.graphdef, ckpt.params), dst, dtype=ckpt.dtype,
                                 generation_config=ckpt.generation_config,
                                 tokenizer_folder=tokens)
    dst = Path(dst).expanduser().resolve()
    if dst.exists():
        raise CheckpointError(f"{dst}: already exists; choose a new folder")
    dst.mkdir(parents=True)
    tok_dir = dst / "tokenizer"
    tok_dir.mkdir()
    if ckpt.format == "gguf":
        meta_in = ckpt.gguf_metadata or {}
        keep = {k: _json_safe(v) for k, v in meta_in.items() if k.startswith("tokenizer.")}
        (tok_dir / "gguf_tokenizer.json").write_text(json.dumps(keep))
        tokenizer_kind = "gguf"
    elif ckpt.format == "hf":
        for name in HF_TOKENIZER_FILES:
            if (ckpt.path / name).is_file():
                shutil.copy2(ckpt.path / name, tok_dir / name)
        tokenizer_kind = "hf"
    else:
        shutil.copytree(ckpt.path / "tokenizer", tok_dir, dirs_exist_ok=True)
        tokenizer_kind = json.loads((ckpt.path / "metrale.json").read_text())["tokenizer"]
    pure = nnx.to_pure_dict(ckpt.params)
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(dst / "params", pure)
        if ckpt.vision is not None:  # a vision-language model's vision encoder, beside
            checkpointer.save(dst / "vision", nnx.to_pure_dict(ckpt.vision[1]))
        checkpointer.wait_until_finished()
    meta = {
        "format_version": FORMAT_VERSION,
        "config": ckpt.config.to_dict(),
        "dtype": ckpt.dtype,
        "source": str(ckpt.path),
        "tokenizer": tokenizer_kind,
        "chat_template": ckpt.chat_template,
        "generation_config": _json_safe(ckpt.generation_config),
        "image_processor": _json_safe(ckpt.image_processor),
    }
    (dst / "metrale.json").write_text(json.dumps(meta, indent=2))
    log.info("wrote %s", dst)
    return dst


def read_metadata(path: Path) -> dict[str, Any]:
    """The parsed `metrale.json` of a checkpoint folder, checked for its format version."""
    meta_path = path / "metrale.json"
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{meta_path}: cannot read ({e})") from None
    if meta.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{meta_path}: unsupported format_version "
                              f"{meta.get('format_version')!r} (expected {FORMAT_VERSION})")
    return meta


Shardings = Callable[[dict[str, Any]], Any] | dict[str, Any]
"""Where each param goes: a pytree of `jax.sharding.Sharding`s shaped like the params' pure
dict (`nnx.to_pure_dict`: `{"embed": ..., "blocks": {"attn": {"q_proj": ...}}, ...}`), or a
function from that dict of `jax.ShapeDtypeStruct`s to one."""


def _cast(x: Any, dtype: Any) -> Any:
    """`x` (an array or `ShapeDtypeStruct`) in `dtype` if it is floating; int8 weights of a
    quantized model (`models/quant.py`) keep their dtype."""
    if not jax.numpy.issubdtype(x.dtype, jax.numpy.floating):
        return x
    if isinstance(x, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(x.shape, dtype)
    return x.astype(dtype)


def _jnp_dtype(name: str) -> Any:
    return np.dtype(name) if name == "float32" else jax.numpy.bfloat16


def load_orbax(path: Path, dtype: str | None = None, shardings: Shardings | None = None):
    """Loads a Metrale checkpoint folder into a `Checkpoint`; `dtype` casts the params.

    shardings: None restores every array whole onto the default device (as before). Given
    (see `Shardings`), every array is restored straight into its sharding, already in `dtype`
    (orbax casts while reading: a float32 checkpoint never occupies float32 memory as
    bfloat16 params), reading only the slices of this process's devices. Params keep the
    stacked `[L, ...]` layout; e.g. `shardings=functools.partial(param_shardings, mesh=mesh)`
    with `metrale_jax.engine.sharding.param_shardings`.
    """

    if dtype is not None:
        check_dtype(dtype)
    path = Path(path).expanduser().resolve()
    meta = read_metadata(path)
    config = ModelConfig.from_dict(meta["config"])
    stored = meta["dtype"]
    graphdef, abstract = abstract_model(config, _jnp_dtype(stored))
    target = nnx.to_pure_dict(abstract)
    if shardings is not None:
        target = _sharded_target(target, shardings, _jnp_dtype(dtype or stored))
    if not (path / "params").is_dir():
        raise CheckpointError(f"{path / 'params'}: the params folder is missing")
    try:
        with ocp.StandardCheckpointer() as checkpointer:
            restored = checkpointer.restore(path / "params", target)
    except (ValueError, KeyError, FileNotFoundError, OSError) as e:
        raise CheckpointError(f"{path / 'params'}: cannot restore params ({e})") from None
    if shardings is None and dtype is not None and dtype != stored:
        restored = jax.tree.map(lambda x: _cast(x, dtype), restored)
    state = jax.tree.map(lambda x: x, abstract)
    nnx.replace_by_pure_dict(state, restored)
    tokenizer = _load_tokenizer(path / "tokenizer", meta["tokenizer"])
    vision = _load_vision(path, config, stored, dtype) if config.vision is not None else None
    return Checkpoint(
        name=str(path), path=path, format="orbax", config=config, graphdef=graphdef,
        params=state, tokenizer=tokenizer, chat_template=meta.get("chat_template"),
        generation_config=meta.get("generation_config") or {}, dtype=dtype or stored,
        vision=vision, image_processor=meta.get("image_processor"))


def _load_vision(path: Path, config: ModelConfig, stored: str,
                 dtype: str | None) -> tuple[nnx.GraphDef, nnx.State]:
    """A vision-language model's vision encoder from `path/vision` (restored whole: the
    engine replicates it)."""
    graphdef, abstract = abstract_vision(config.vision, _jnp_dtype(stored))
    try:
        with ocp.StandardCheckpointer() as checkpointer:
            restored = checkpointer.restore(path / "vision", nnx.to_pure_dict(abstract))
    except (ValueError, KeyError, FileNotFoundError, OSError) as e:
        raise CheckpointError(f"{path / 'vision'}: cannot restore the vision encoder "
                              f"({e})") from None
    if dtype is not None and dtype != stored:
        restored = jax.tree.map(lambda x: x.astype(dtype), restored)
    state = jax.tree.map(lambda x: x, abstract)
    nnx.replace_by_pure_dict(state, restored)
    return graphdef, state


def _sharded_target(target: dict[str, Any], shardings: Shardings, dtype: Any) -> dict[str, Any]:
    """The restore target: `target`'s shapes in `dtype`, each with its sharding."""
    tree = shardings(target) if callable(shardings) else shardings
    try:
        return jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, _cast(a, dtype).dtype, sharding=s),
            target, tree)
    except ValueError as e:  # the shardings' tree does not match the params'
        raise ValueError(f"shardings do not match the checkpoint's params: {e}") from None


def _load_tokenizer(folder: Path, kind: str):
    if kind == "gguf":
        try:
            meta = json.loads((folder / "gguf_tokenizer.json").read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{folder / 'gguf_tokenizer.json'}: cannot read ({e})") from None
        return tokenizer_from_gguf_metadata(meta)
    return load_tokenizer(folder)
