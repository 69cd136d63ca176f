"""Reads a llama.cpp GGUF file into canonical tensors.

`read_gguf(path)` returns `(ModelConfig, tensors, metadata)`: `tensors` uses Hugging Face
transformers' parameter names and shapes (as `LlamaForCausalLM` and friends store them), every
array float32 (dequantized), so the models layer never sees llama.cpp's conventions. Undone
here:

- GGUF lists dims innermost first; numpy shapes are the reverse (`[out, in]`).
- llama.cpp's converter permutes the rows of Q and K (and their biases) for the `llama`
  architecture (its family's `gguf_permuted_qk`), to turn HF's half-split RoPE into
  interleaved pairs; we apply the inverse.
- llama.cpp stores Gemma norm weights as `1 + w`; we subtract 1 so values equal HF's.
- Llama 3 RoPE scaling lives in a `rope_freqs.weight` tensor, not metadata (see gguf_names).

The file is memory-mapped; its header is parsed by `gguf_header.read_header` (exact, ~50x
faster than `gguf.GGUFReader` on a vocabulary: that module says why), falling back to
`GGUFReader` for any file the fast parse does not read exactly as it would. Tensors are
dequantized with gguf's own per-type block codecs (`gguf.quants.Q4_1.dequantize_rows`, ...)
called on chunks of 16 MB of float32 output written into their final arrays: the same
elementwise arithmetic as `gguf.quants.dequantize`, hence the same float32 bits, without its
per-16-rows split and concatenate (2-3x faster on the default model), and peak memory stays
near the size of the result. `read_gguf(..., reference=True)` reads with `GGUFReader` and
`gguf.quants.dequantize` alone: the library's own reading, for tests and `bench/load.py`.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf.quants
import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType
from gguf.gguf_reader import ReaderField
from gguf.quants import dequantize

from metrale_jax.config import ModelConfig
from metrale_jax.errors import CheckpointError, UnsupportedModelError
from metrale_jax.families import family_of_config
from metrale_jax.weights.gguf_header import (
    GGUF_MAGIC,
    FastPathError,
    TensorInfo,
    decode_text,
    read_header,
)
from metrale_jax.weights.gguf_names import (
    IGNORED_LAYER_SUFFIXES,
    ROPE_FACTORS_LONG,
    ROPE_FACTORS_SHORT,
    ROPE_FREQS,
    ROPE_TABLES,
    config_from_metadata,
    expected_shapes,
    hf_name,
)

log = logging.getLogger(__name__)

# Tensor types we dequantize (all with gguf's numpy kernels).
SUPPORTED_TYPES: frozenset[GGMLQuantizationType] = frozenset({
    GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16,
    GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1,
    GGMLQuantizationType.Q5_0, GGMLQuantizationType.Q5_1, GGMLQuantizationType.Q4_K,
    GGMLQuantizationType.Q5_K, GGMLQuantizationType.Q6_K,
})

# gguf's block codec of each quantized type: `dequantize_rows(uint8 [rows, bytes]) -> float32`.
_ROW_CODECS = {t: getattr(gguf.quants, t.name) for t in SUPPORTED_TYPES
               if t not in (GGMLQuantizationType.F32, GGMLQuantizationType.F16)}
# float32 output per codec call. Measured in fresh processes: 8-32 MB (and <= 1 MB) alike;
# 2-4 MB ~1.8x slower, glibc then returning the codec's temporaries to the OS every call.
_CHUNK_BYTES = 16 << 20
_REFERENCE_CHUNK_BYTES = 32 << 20  # per `gguf.quants.dequantize` call on the reference path


def read_gguf(path: str | os.PathLike[str], *,
              progress: Callable[[int, int], None] | None = None, reference: bool = False,
              ) -> tuple[ModelConfig, dict[str, np.ndarray], dict[str, Any]]:
    """Reads a GGUF checkpoint.

    Returns `(config, tensors, metadata)`:
        config: the `ModelConfig` built from the file's metadata and tensor list.
        tensors: HF name -> float32 array in HF layout, e.g. `model.embed_tokens.weight: [V, E]`,
            `model.layers.{i}.self_attn.q_proj.weight: [H*D, E]`, `...k_proj.weight: [K*D, E]`,
            `...o_proj.weight: [E, H*D]`, `...mlp.down_proj.weight: [E, F]`, norms `[E]` (or
            `[D]` for Qwen3's q/k norms) with HF's values. `lm_head.weight: [V, E]` is absent
            when `config.tie_word_embeddings`.
        metadata: every key-value field of the file as plain Python values (str, int, float,
            bool, or lists of them, e.g. `tokenizer.ggml.tokens: list[str]`).

    `progress(done, total)` is called after each tensor. `reference=True` reads with the gguf
    library alone (`GGUFReader`, `gguf.quants.dequantize`): slower, the same result. Raises
    `CheckpointError` (naming the file) for a missing, truncated or malformed file, a missing
    tensor or a tensor whose shape disagrees with the config; `UnsupportedModelError` for an
    architecture or tensor type Metrale-JAX does not implement.
    """
    path = Path(path)
    metadata, tensor_list = read_gguf_header(path, reference=reference)
    if int(metadata.get("split.count") or 1) > 1:
        tensor_list = read_split_tensors(path, metadata, tensor_list, reference)
    by_name = {t.name: t for t in tensor_list}
    shapes = {name: t.numpy_shape for name, t in by_name.items()}
    rope_freqs = (_dequantize(by_name[ROPE_FREQS], path, reference) if ROPE_FREQS in by_name
                  else None)
    rope_factors = (tuple(_dequantize(by_name[n], path, reference)
                          for n in (ROPE_FACTORS_LONG, ROPE_FACTORS_SHORT))
                    if ROPE_FACTORS_LONG in by_name and ROPE_FACTORS_SHORT in by_name else None)
    config = config_from_metadata(metadata, shapes, path, rope_freqs, rope_factors)
    plan = _plan(config, by_name, shapes, path)

    permuted_qk = family_of_config(config.architecture).gguf_permuted_qk
    tensors: dict[str, np.ndarray] = {}
    for done, (name, tensor) in enumerate(plan.items(), start=1):
        array = _dequantize(tensor, path, reference)
        if permuted_qk and ".self_attn.q_proj." in name:
            array = _unpermute(array, config.num_heads, tensor.name, path)
        elif permuted_qk and ".self_attn.k_proj." in name:
            array = _unpermute(array, config.num_kv_heads, tensor.name, path)
        if config.norm_weight_offset and name.endswith("norm.weight"):
            array -= 1.0
        tensors[name] = array
        if progress is not None:
            progress(done, len(plan))
    del tensor_list, by_name  # drop the memory map
    return config, tensors, metadata


SPLIT_NAME = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$")
"""llama.cpp's name of a split GGUF's part: `PREFIX-00001-of-00003.gguf`."""


def read_split_tensors(path: Path, metadata: dict[str, Any], first: list[TensorInfo],
                       reference: bool = False) -> list[TensorInfo]:
    """The tensors of a split GGUF (llama.cpp's `llama-gguf-split`: the model's metadata in
    the first part, each part holding some tensors) whose first part is `path` (its
    `metadata` and tensors `first` read): every part's `TensorInfo`s, each viewing its own
    file. The parts are found beside `path` by name (`SPLIT_NAME`); `CheckpointError` names a
    missing or mismatched part."""
    count = int(metadata["split.count"])
    match = SPLIT_NAME.search(path.name)
    if int(metadata.get("split.no") or 0) != 0 or match is None or int(match[2]) != count:
        raise CheckpointError(
            f"{path}: part of a split GGUF of {count} files; load its first part "
            f"(PREFIX-00001-of-{count:05d}.gguf)")
    tensors = list(first)
    for i in range(2, count + 1):
        part = path.with_name(SPLIT_NAME.sub(f"-{i:05d}-of-{count:05d}.gguf", path.name))
        if not part.is_file():
            raise CheckpointError(f"{path}: split GGUF part {part.name} is missing")
        meta, more = read_gguf_header(part, reference=reference)
        if int(meta.get("split.no", -1)) != i - 1 or int(meta.get("split.count", 0)) != count:
            raise CheckpointError(f"{part}: not part {i} of {count} of {path.name}")
        tensors += more
    want = metadata.get("split.tensors.count")
    if want is not None and int(want) != len(tensors):
        raise CheckpointError(f"{path}: the split GGUF's parts hold {len(tensors)} tensors, "
                              f"its first part says {want}")
    return tensors


def unpermute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverts llama.cpp's `permute(w, n_head)` on the rows of a Q or K projection.

    `w: [n_head * D, ...]` (a weight `[n_head * D, E]` or a bias `[n_head * D]`). llama.cpp
    reorders each head's rows from HF's two halves into interleaved pairs; this puts them back.
    Returns a new array of the same shape.
    """
    rows = w.shape[0]
    if rows % (2 * n_head):
        raise ValueError(f"{rows} rows do not split into {n_head} heads of even size")
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _unpermute(w: np.ndarray, n_head: int, gguf_name: str, path: Path) -> np.ndarray:
    try:
        return unpermute_rows(w, n_head)
    except ValueError as e:
        raise CheckpointError(f"{path}: tensor {gguf_name!r}: {e}") from None


def read_gguf_header(path: str | os.PathLike[str], *, reference: bool = False,
                     ) -> tuple[dict[str, Any], list[TensorInfo]]:
    """`(metadata, tensors)` of a GGUF file without reading any tensor's values.

    `metadata` is `read_gguf`'s; `tensors` one `TensorInfo` per tensor in file order, its
    `data` a memory-mapped view. Read by `gguf_header.read_header`, or by `gguf.GGUFReader`
    when that parse declines the file or with `reference=True`: the same result either way.
    Raises `CheckpointError` / `UnsupportedModelError` as `read_gguf` does.
    """
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path}: no such file")
    if not path.is_file():
        raise CheckpointError(f"{path}: not a file")
    try:
        with path.open("rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read the file ({e.strerror})") from None
    if magic != GGUF_MAGIC:
        raise CheckpointError(f"{path}: not a GGUF file (bad magic {magic!r}, expected b'GGUF')")
    header = None
    if not reference:
        try:
            header = read_header(path)
        except FastPathError as e:
            log.debug("%s: reading the header with GGUFReader (%s)", path, e)
    if header is not None:
        metadata, tensors = header.metadata, header.tensors
    else:
        metadata, tensors = _open_with_library(path)
    size = path.stat().st_size
    for t in tensors:
        if t.data.nbytes != t.n_bytes or t.data_offset + t.n_bytes > size:
            raise CheckpointError(f"{path}: truncated GGUF file (tensor {t.name!r} needs "
                                  f"bytes up to {t.data_offset + t.n_bytes}, file has {size})")
    return metadata, tensors


def _open_with_library(path: Path) -> tuple[dict[str, Any], list[TensorInfo]]:
    try:
        reader = GGUFReader(path)
    except Exception as e:  # gguf raises ValueError, IndexError, KeyError... on bad bytes
        raise CheckpointError(f"{path}: truncated or corrupt GGUF file "
                              f"({type(e).__name__}: {e})") from None
    if reader.byte_order != "I":
        raise UnsupportedModelError(f"{path}: GGUF files of the other byte order are not "
                                    "supported")
    metadata = _metadata(reader, path)
    return metadata, [TensorInfo.from_reader(t) for t in reader.tensors]


def _decode(part: np.ndarray, key: str) -> str:
    return decode_text(part.tobytes(), key)


def _field_value(field: ReaderField) -> Any:
    """One metadata field as a plain Python value (list for arrays)."""
    types = field.types
    if not types:
        return None
    if types[0] == GGUFValueType.ARRAY:
        if len(types) == 1:  # empty array
            return []
        if len(types) > 2:  # nested arrays: gguf flattens them; keep its reading
            return field.contents()
        if types[1] == GGUFValueType.STRING:
            return [_decode(field.parts[i], field.name) for i in field.data]
        if not field.data:
            return []
        return np.concatenate([field.parts[i] for i in field.data]).tolist()
    part = field.parts[field.data[0]]
    if types[0] == GGUFValueType.STRING:
        return _decode(part, field.name)
    if types[0] == GGUFValueType.FLOAT32:
        return float(str(part[0]))  # shortest decimal that round-trips: 1e-05, not 9.99e-06
    return part[0].item()


def _metadata(reader: GGUFReader, path: Path) -> dict[str, Any]:
    """Every key-value field (the reader's `GGUF.*` header entries excluded)."""
    try:
        return {key: _field_value(field) for key, field in reader.fields.items()
                if not key.startswith("GGUF.")}
    except Exception as e:
        raise CheckpointError(f"{path}: corrupt GGUF metadata ({type(e).__name__}: {e})") from None


def _plan(config: ModelConfig, by_name: dict[str, TensorInfo],
          shapes: dict[str, tuple[int, ...]], path: Path) -> dict[str, TensorInfo]:
    """HF name -> GGUF tensor for every parameter, after checking names, shapes and types."""
    want, optional = expected_shapes(config)
    plan: dict[str, TensorInfo] = {}
    unknown: list[str] = []
    for gguf_name, tensor in by_name.items():
        if gguf_name in ROPE_TABLES or gguf_name.endswith(IGNORED_LAYER_SUFFIXES):
            continue
        name = hf_name(gguf_name, config.architecture)
        if name is None or name not in want:
            unknown.append(gguf_name)
            continue
        if shapes[gguf_name] != want[name]:
            raise CheckpointError(
                f"{path}: tensor {gguf_name!r} has shape {list(shapes[gguf_name])}, but the "
                f"config calls for {list(want[name])} (as {name})")
        if tensor.tensor_type not in SUPPORTED_TYPES:
            raise UnsupportedModelError(
                f"{path}: tensor {gguf_name!r} has type {tensor.tensor_type.name}, which "
                "Metrale-JAX cannot dequantize (supported: "
                f"{', '.join(sorted(t.name for t in SUPPORTED_TYPES))})")
        plan[name] = tensor
    if unknown:
        raise UnsupportedModelError(
            f"{path}: {len(unknown)} tensor(s) this {config.architecture} reader does not "
            f"know, e.g. {', '.join(unknown[:3])}")
    missing = [n for n in want if n not in plan and n not in optional]
    if missing:
        raise CheckpointError(f"{path}: {len(missing)} required tensor(s) missing, e.g. "
                              f"{', '.join(missing[:3])}")
    return plan


def _dequantize(t: TensorInfo, path: Path, reference: bool = False) -> np.ndarray:
    """The tensor as a new float32 array in numpy (HF) shape, dequantized in row chunks."""
    shape = t.numpy_shape
    if t.tensor_type not in SUPPORTED_TYPES:
        raise UnsupportedModelError(f"{path}: tensor {t.name!r} has unsupported type "
                                    f"{t.tensor_type.name}")
    try:
        if t.tensor_type == GGMLQuantizationType.F32:
            return np.array(t.data, dtype=np.float32).reshape(shape)
        cols = shape[-1] if shape else 1
        rows = t.data.reshape(-1, t.data.shape[-1] if t.data.ndim else 1)
        out = np.empty((rows.shape[0], cols), dtype=np.float32)
        codec = None if reference else _ROW_CODECS.get(t.tensor_type)
        step = max(1, (_REFERENCE_CHUNK_BYTES if codec is None else _CHUNK_BYTES) // (4 * cols))
        for start in range(0, rows.shape[0], step):
            chunk = rows[start:start + step]
            out[start:start + step] = (dequantize(chunk, t.tensor_type) if codec is None
                                       else codec.dequantize_rows(chunk))
        return out.reshape(shape)
    except (ValueError, OSError) as e:
        raise CheckpointError(f"{path}: cannot read tensor {t.name!r} "
                              f"({type(e).__name__}: {e})") from None
