"""Loads an M2M100 / NLLB-200 model from a Hugging Face folder, and to and from orbax.

`load_m2m100(folder)` reads `config.json`, `generation_config.json` (optional) and the
safetensors tensors (`model.safetensors` or a sharded set with its index, through
`safetensors_reader`), and builds a `metrale_jax.models.m2m100.M2M100` whose params use our
[in, out] layout: Hugging Face's `[out, in]` matrices are transposed once, here.

Embeddings: a checkpoint may store `model.shared.weight`, or only the encoder's/decoder's
`embed_tokens.weight`, or only the tied `lm_head.weight`; any of them serves (the first present
in that order). Names may also lack the `model.` prefix (an `M2M100Model` checkpoint).

`save_m2m100_orbax` / `load_m2m100_orbax` store the params with orbax beside a `metrale.json`
(`"family": "m2m100"`) and the tokenizer files, following `orbax_store.py`.
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from metrale_jax.config import ModelConfig, check_dtype
from metrale_jax.errors import CheckpointError
from metrale_jax.families import family_of_hf
from metrale_jax.families.m2m100 import M2M100Config
from metrale_jax.models.m2m100 import M2M100, abstract_m2m100

log = logging.getLogger(__name__)

FAMILY = "m2m100"
FORMAT_VERSION = 1
NLLB_TOKENIZER_FILES = ("sentencepiece.bpe.model", "tokenizer.json", "tokenizer_config.json",
                        "special_tokens_map.json", "added_tokens.json")
EMBED_NAMES = ("model.shared.weight", "model.encoder.embed_tokens.weight",
               "model.decoder.embed_tokens.weight")


def read_m2m100_config(folder: Path) -> M2M100Config:
    """Reads `folder/config.json` into an `M2M100Config` (errors name the file)."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{folder}: no config.json in this Hugging Face folder")
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None
    try:
        return M2M100Config.from_hf(raw)
    except CheckpointError as e:  # UnsupportedModelError included: add the file's name
        raise type(e)(f"{path}: {e.message}") from None


def _attention_specs(prefix: str, ours: str, E: int, H: int, D: int,
                     ) -> dict[tuple[str, ...], tuple[str, Callable]]:
    return {
        (ours, "q_proj"): (prefix + "q_proj.weight", lambda w: w.T.reshape(E, H, D)),
        (ours, "k_proj"): (prefix + "k_proj.weight", lambda w: w.T.reshape(E, H, D)),
        (ours, "v_proj"): (prefix + "v_proj.weight", lambda w: w.T.reshape(E, H, D)),
        (ours, "o_proj"): (prefix + "out_proj.weight", lambda w: w.T.reshape(H, D, E)),
        (ours, "q_bias"): (prefix + "q_proj.bias", lambda b: b.reshape(H, D)),
        (ours, "k_bias"): (prefix + "k_proj.bias", lambda b: b.reshape(H, D)),
        (ours, "v_bias"): (prefix + "v_proj.bias", lambda b: b.reshape(H, D)),
        (ours, "o_bias"): (prefix + "out_proj.bias", lambda b: b),
    }


def _norm_specs(name: str, ours: str) -> dict[tuple[str, ...], tuple[str, Callable]]:
    return {(ours, "weight"): (name + ".weight", lambda w: w),
            (ours, "bias"): (name + ".bias", lambda b: b)}


def _ffn_specs(p: str) -> dict[tuple[str, ...], tuple[str, Callable]]:
    return {("ffn", "fc1"): (p + "fc1.weight", lambda w: w.T),
            ("ffn", "fc1_bias"): (p + "fc1.bias", lambda b: b),
            ("ffn", "fc2"): (p + "fc2.weight", lambda w: w.T),
            ("ffn", "fc2_bias"): (p + "fc2.bias", lambda b: b)}


def layer_specs(cfg: M2M100Config, stack: str) -> dict[tuple[str, ...], tuple[str, Callable]]:
    """Our per-layer param path -> (HF name pattern with `{i}`, HF tensor -> ours), for
    `stack` "encoder" or "decoder"."""
    E = cfg.d_model
    if stack == "encoder":
        H, D = cfg.encoder_attention_heads, cfg.encoder_head_dim
    else:
        H, D = cfg.decoder_attention_heads, cfg.decoder_head_dim
    p = f"model.{stack}.layers.{{i}}."
    specs = {
        **_norm_specs(p + "self_attn_layer_norm", "self_attn_norm"),
        **_attention_specs(p + "self_attn.", "self_attn", E, H, D),
        **_norm_specs(p + "final_layer_norm", "ffn_norm"),
        **_ffn_specs(p),
    }
    if stack == "decoder":
        specs |= _norm_specs(p + "encoder_attn_layer_norm", "cross_attn_norm")
        specs |= _attention_specs(p + "encoder_attn.", "cross_attn", E, H, D)
    return specs


def _set(tree: dict, path: tuple[str, ...], value: Any) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def _get(tree: Any, path: tuple[str, ...]) -> Any:
    for key in path:
        tree = tree[key]
    return tree


def assemble_m2m100(cfg: M2M100Config, tensors: Mapping[str, np.ndarray], source: Path | str,
                    dtype: Any = jnp.float32) -> tuple[nnx.GraphDef, nnx.State]:
    """Builds `(graphdef, params)` of `M2M100(cfg)` from HF-named tensors, cast to `dtype`.

    Raises `CheckpointError` naming `source` and the tensor when one is missing or its shape
    disagrees with the config.
    """
    graphdef, abstract = abstract_m2m100(cfg, dtype)
    want = nnx.to_pure_dict(abstract)
    if not any(name.startswith("model.") for name in tensors):  # an M2M100Model checkpoint
        tensors = {("" if n.startswith("lm_head.") else "model.") + n: t
                   for n, t in tensors.items()}
    out: dict = {}

    def take(name: str) -> np.ndarray:
        if name not in tensors:
            raise CheckpointError(f"{source}: tensor {name!r} is missing")
        return np.asarray(tensors[name])

    def place(path: tuple[str, ...], value: np.ndarray, name: str) -> None:
        expected = tuple(_get(want, path).shape)
        if tuple(value.shape) != expected:
            raise CheckpointError(
                f"{source}: tensor {name!r} has shape {tuple(value.shape)}, but the config "
                f"implies {expected}")
        _set(out, path, jnp.asarray(value, dtype))

    def reshaped(fn: Callable, w: np.ndarray, name: str, path: tuple[str, ...]) -> np.ndarray:
        layer_shape = tuple(_get(want, path).shape[1:])
        try:
            value = fn(w)
        except ValueError:
            value = None
        if value is None or tuple(value.shape) != layer_shape:
            raise CheckpointError(
                f"{source}: tensor {name!r} has shape {tuple(w.shape)}, which does not fit "
                f"the config's {layer_shape} (our layout)")
        return value

    embed_names = EMBED_NAMES + (("lm_head.weight",) if cfg.tie_word_embeddings else ())
    embed_name = next((n for n in embed_names if n in tensors), EMBED_NAMES[0])
    place(("shared",), take(embed_name), embed_name)
    if not cfg.tie_word_embeddings:
        place(("lm_head",), take("lm_head.weight").T, "lm_head.weight")
    for stack, L in (("encoder", cfg.encoder_layers), ("decoder", cfg.decoder_layers)):
        norm = f"model.{stack}.layer_norm"
        place((f"{stack}_norm", "weight"), take(norm + ".weight"), norm + ".weight")
        place((f"{stack}_norm", "bias"), take(norm + ".bias"), norm + ".bias")
        for path, (pattern, fn) in layer_specs(cfg, stack).items():
            full = (f"{stack}_layers", *path)
            layers = []
            for i in range(L):
                name = pattern.format(i=i)
                layers.append(reshaped(fn, take(name), name, full))
            place(full, np.stack(layers), pattern.format(i="*"))
    state = jax.tree.map(lambda x: x, abstract)
    nnx.replace_by_pure_dict(state, out)
    return graphdef, state


def read_generation_config(folder: Path) -> dict[str, Any]:
    """The parsed `generation_config.json`, or `{}` when the folder has none."""
    path = Path(folder) / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None


def load_m2m100(folder: Path | str, dtype: str = "float32",
                ) -> tuple[M2M100, M2M100Config, dict[str, Any]]:
    """Loads a Hugging Face M2M100/NLLB folder: `(model, config, generation_config)`.

    dtype: "float32" or "bfloat16", the params dtype. The model is an `M2M100` module (split
    it with `nnx.split` for jit-compiled steps). Raises `CheckpointError` (naming the file or
    tensor) for a missing, malformed or mis-shaped file or tensor, `UnsupportedModelError` for
    another architecture.
    """
    from metrale_jax.weights.safetensors_reader import read_safetensors

    check_dtype(dtype)
    folder = Path(folder).expanduser()
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: not a folder")
    cfg = read_m2m100_config(folder)
    generation = read_generation_config(folder)
    tensors = read_safetensors(folder)
    graphdef, params = assemble_m2m100(cfg, tensors, folder, jnp.dtype(dtype))
    del tensors
    log.info("loaded M2M100 %s (%s)", folder, dtype)
    return nnx.merge(graphdef, params), cfg, generation


# ---- orbax ----------------------------------------------------------------------------------

def save_m2m100_orbax(model: M2M100, dst: Path | str, *, dtype: str | None = None,
                      generation_config: dict[str, Any] | None = None,
                      tokenizer_folder: Path | str | None = None) -> Path:
    """Writes `model` to `dst` (which must not exist yet): `metrale.json` (family "m2m100",
    config, dtype, generation config), `params/` (orbax) and `tokenizer/` (the NLLB tokenizer
    files found in `tokenizer_folder`, if given). Returns `dst`."""
    import orbax.checkpoint as ocp

    dst = Path(dst).expanduser().resolve()
    if dst.exists():
        raise CheckpointError(f"{dst}: already exists; choose a new folder")
    dst.mkdir(parents=True)
    tok_dir = dst / "tokenizer"
    tok_dir.mkdir()
    if tokenizer_folder is not None:
        for name in NLLB_TOKENIZER_FILES:
            if (Path(tokenizer_folder) / name).is_file():
                shutil.copy2(Path(tokenizer_folder) / name, tok_dir / name)
    _, params = nnx.split(model)
    pure = nnx.to_pure_dict(params)
    stored = dtype or str(jax.tree.leaves(pure)[0].dtype)
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(dst / "params", pure)
        checkpointer.wait_until_finished()
    meta = {"format_version": FORMAT_VERSION, "family": FAMILY, "config": model.cfg.to_dict(),
            "dtype": stored, "generation_config": generation_config or {}}
    (dst / "metrale.json").write_text(json.dumps(meta, indent=2))
    log.info("wrote %s", dst)
    return dst


def load_m2m100_orbax(path: Path | str, dtype: str | None = None,
                      ) -> tuple[M2M100, M2M100Config, dict[str, Any]]:
    """Loads what `save_m2m100_orbax` wrote: `(model, config, generation_config)`; `dtype`
    casts the params (None keeps the stored dtype). The tokenizer is in `path/tokenizer`
    (`metrale_jax.text.nllb.load_nllb_tokenizer`)."""
    import orbax.checkpoint as ocp

    if dtype is not None:
        check_dtype(dtype)
    path = Path(path).expanduser().resolve()
    meta_path = path / "metrale.json"
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{meta_path}: cannot read ({e})") from None
    if meta.get("format_version") != FORMAT_VERSION or meta.get("family") != FAMILY:
        raise CheckpointError(f"{meta_path}: not an M2M100 checkpoint of format version "
                              f"{FORMAT_VERSION} (family {meta.get('family')!r})")
    cfg = M2M100Config.from_dict(meta["config"])
    stored = meta["dtype"]
    graphdef, abstract = abstract_m2m100(cfg, jnp.dtype(stored))
    if not (path / "params").is_dir():
        raise CheckpointError(f"{path / 'params'}: the params folder is missing")
    try:
        with ocp.StandardCheckpointer() as checkpointer:
            restored = checkpointer.restore(path / "params", nnx.to_pure_dict(abstract))
    except (ValueError, KeyError, FileNotFoundError, OSError) as e:
        raise CheckpointError(f"{path / 'params'}: cannot restore params ({e})") from None
    if dtype is not None and dtype != stored:
        restored = jax.tree.map(lambda x: x.astype(dtype), restored)
        graphdef, abstract = abstract_m2m100(cfg, jnp.dtype(dtype))
    state = jax.tree.map(lambda x: x, abstract)
    nnx.replace_by_pure_dict(state, restored)
    return nnx.merge(graphdef, state), cfg, meta.get("generation_config") or {}


# ---- the loader's entry -----------------------------------------------------------------------

def is_m2m100_folder(path: Path, fmt: str) -> bool:
    """Whether `path` (a folder of format "hf" or "orbax") holds an M2M100/NLLB model."""
    try:
        if fmt == "hf":
            model_type = json.loads((path / "config.json").read_text()).get("model_type")
            family = family_of_hf(model_type)
            return family is not None and family.kind == "encoder_decoder"
        if fmt == "orbax":
            return json.loads((path / "metrale.json").read_text()).get("family") == FAMILY
    except (OSError, json.JSONDecodeError):
        return False
    return False


def load_m2m100_checkpoint(name: str, path: Path, fmt: str, dtype: str | None,
                           shardings: Callable | None = None):
    """A `Checkpoint` of an M2M100/NLLB folder (format "hf" or "orbax"): its config is the
    engine's `ModelConfig` (`ModelConfig.for_m2m100`), its tokenizer an `NllbTokenizer`,
    no chat template. `shardings` (the placement hook) is called with the config before any
    weight is read; the params load on the default device and the engine places them."""
    from metrale_jax.text.nllb import load_nllb_tokenizer
    from metrale_jax.weights.loaded import Checkpoint

    if fmt == "orbax":
        meta = json.loads((path / "metrale.json").read_text())
        cfg = M2M100Config.from_dict(meta["config"])
        stored = meta["dtype"]
        if shardings is not None:
            shardings(ModelConfig.for_m2m100(cfg), dtype or stored)
        model, cfg, generation = load_m2m100_orbax(path, dtype)
        tokenizer = load_nllb_tokenizer(path / "tokenizer")
        dtype = dtype or stored
    else:
        dtype = dtype or "float32"
        cfg = read_m2m100_config(path)
        if shardings is not None:
            shardings(ModelConfig.for_m2m100(cfg), dtype)
        model, cfg, generation = load_m2m100(path, dtype)
        tokenizer = load_nllb_tokenizer(path)
    graphdef, params = nnx.split(model)
    return Checkpoint(name, path, fmt, ModelConfig.for_m2m100(cfg), graphdef, params, tokenizer,
                      None, generation, dtype, None)
