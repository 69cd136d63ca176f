"""What checkpoints lie in a folder, read from their headers without loading any weights.

`describe(path)` returns a `CheckpointInfo` (format, architecture, size on disk, parameter
count, stored dtype) of one checkpoint; `list_checkpoints(folder)` describes every entry of a
folder (default: `checkpoints_dir()`). Each format is read from what it writes up front:

- GGUF: the file header (key-value metadata and the tensor index), parsed here with `struct`
  over a memory map, skipping the values it does not need (a 49k-token vocabulary costs a few
  milliseconds; `gguf.GGUFReader` would decode every field).
- Hugging Face folders: `config.json` and the JSON header of each safetensors file.
- Metrale (orbax) folders: `metrale.json`; the parameter count comes from the model's
  abstract shapes (`jax.eval_shape`, no arrays allocated).

An entry that can't be read is still listed, with its error, so one bad file never hides the
others.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import mmap
import struct
from pathlib import Path
from typing import Any

from metrale_jax.errors import MetraleError
from metrale_jax.weights.default_model import checkpoints_dir, default_model_path

IGNORED_NAMES = ("README.md",)
IGNORED_SUFFIXES = (".partial", ".tmp")
_NOT_PARAMS = ("rope_freqs.weight",)  # a RoPE buffer stored as a tensor, not a parameter


@dataclasses.dataclass(frozen=True)
class CheckpointInfo:
    """One checkpoint as `metrale models` lists it.

    format: "gguf", "hf", "orbax" or "lora" (a PEFT adapter folder; None when the entry is
    not a checkpoint).
    architecture: the model family ("llama", "qwen2", ...), as the checkpoint names it.
    size_bytes: bytes on disk (every file of a checkpoint folder; 0 for a folder that is not a
    checkpoint). num_params: parameter count, None when
    it can't be read. dtype: the stored tensor type (the most common one for GGUF, e.g. Q4_1).
    default: True for the default model's file. error: why the entry could not be read.
    """

    name: str
    path: Path
    format: str | None
    architecture: str | None
    size_bytes: int
    num_params: int | None
    dtype: str | None
    default: bool = False
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (the path as a string)."""
        return {**dataclasses.asdict(self), "path": str(self.path)}


def size_on_disk(path: Path) -> int:
    """Bytes of a file, or of every file under a folder."""
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def list_checkpoints(folder: Path | None = None) -> list[CheckpointInfo]:
    """Every checkpoint in `folder` (default: the checkpoints folder), sorted by name."""
    folder = checkpoints_dir() if folder is None else Path(folder)
    if not folder.is_dir():
        return []
    out = []
    for entry in sorted(folder.iterdir(), key=lambda p: p.name):
        if (entry.name.startswith(".") or entry.name in IGNORED_NAMES
                or entry.name.endswith(IGNORED_SUFFIXES)):
            continue
        out.append(describe(entry))
    return out


def list_hub_cache(cache_dir: str | Path | None = None) -> list[CheckpointInfo]:
    """The models in the Hugging Face Hub cache (`HF_HUB_CACHE`, or `cache_dir`): one entry
    per cached revision of a model repo (`org/repo`, `@revision` added where a repo has
    several), or per GGUF file in it (`org/repo/file.gguf`), read as `describe` reads a
    checkpoint, with `error` saying why one would not load (an architecture no family serves,
    files missing). Empty when there is no cache."""
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound
    try:
        cache = scan_cache_dir(cache_dir)
    except CacheNotFound:
        return []
    out = []
    for repo in sorted(cache.repos, key=lambda r: r.repo_id):
        if repo.repo_type != "model":
            continue
        revisions = sorted(repo.revisions, key=lambda r: r.commit_hash)
        for rev in revisions:
            name = repo.repo_id
            if len(revisions) > 1:
                refs = sorted(rev.refs)
                name += "@" + (refs[0] if refs else rev.commit_hash[:12])
            snapshot = Path(rev.snapshot_path)
            ggufs = sorted(snapshot.rglob("*.gguf"))
            entries = [(f"{name}/{g.relative_to(snapshot)}", g) for g in ggufs] or [
                (name, snapshot)]
            for label, path in entries:
                info = dataclasses.replace(describe(path), name=label)
                out.append(dataclasses.replace(info, error=info.error or _unserved(info)))
    return out


def _unserved(info: CheckpointInfo) -> str | None:
    """Why a readable checkpoint would not load: an architecture no family serves."""
    from metrale_jax.families import family_of_gguf, family_of_hf
    if info.format not in ("hf", "gguf") or info.architecture is None:
        return None
    family = (family_of_hf if info.format == "hf" else family_of_gguf)(info.architecture)
    if family is None:
        return f"not served: architecture {info.architecture!r}"
    return None


def describe(path: Path) -> CheckpointInfo:
    """The `CheckpointInfo` of one file or folder (never raises for a bad checkpoint)."""
    path = Path(path)
    is_default = path.resolve() == default_model_path().resolve()
    known = (path.is_file() and path.suffix == ".gguf") or (path.is_dir() and any(
        (path / f).is_file() for f in ("metrale.json", "config.json", "adapter_config.json")))
    # A folder that is no checkpoint is not walked (it may be large); a file costs a stat.
    size = size_on_disk(path) if known or path.is_file() else 0
    base = dict(name=path.name, path=path, size_bytes=size, default=is_default)
    try:
        if path.is_file() and path.suffix == ".gguf":
            arch, params, dtype = _gguf_info(path)
            return CheckpointInfo(format="gguf", architecture=arch, num_params=params,
                                  dtype=dtype, **base)
        if path.is_dir() and (path / "metrale.json").is_file():
            arch, params, dtype = _orbax_info(path)
            return CheckpointInfo(format="orbax", architecture=arch, num_params=params,
                                  dtype=dtype, **base)
        if path.is_dir() and (path / "adapter_config.json").is_file():
            arch, params, dtype = _lora_info(path)
            return CheckpointInfo(format="lora", architecture=arch, num_params=params,
                                  dtype=dtype, **base)
        if path.is_dir() and (path / "config.json").is_file():
            arch, params, dtype = _hf_info(path)
            return CheckpointInfo(format="hf", architecture=arch, num_params=params,
                                  dtype=dtype, **base)
        why = "not a .gguf file, a Hugging Face folder or a Metrale checkpoint"
    except (OSError, ValueError, KeyError, TypeError, struct.error, MetraleError) as e:
        why = getattr(e, "message", None) or f"{type(e).__name__}: {e}"
        fmt = ("gguf" if path.suffix == ".gguf" else "orbax" if (path / "metrale.json").exists()
               else "hf" if (path / "config.json").exists() else None)
        return CheckpointInfo(format=fmt, architecture=None, num_params=None, dtype=None,
                              error=f"cannot read: {why}", **base)
    return CheckpointInfo(format=None, architecture=None, num_params=None, dtype=None,
                          error=why, **base)


# ---- GGUF ------------------------------------------------------------------------------
# Value types of GGUF's key-value section: fixed-size scalars by struct code; 8 = string,
# 9 = array (element type, count, elements).
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
            12: "d"}
_STRING, _ARRAY = 8, 9


class _Cursor:
    """Little-endian reads from a buffer at a moving offset."""

    def __init__(self, buf: Any):
        self.buf = buf
        self.pos = 0

    def read(self, code: str) -> Any:
        value = struct.unpack_from("<" + code, self.buf, self.pos)[0]
        self.pos += struct.calcsize(code)
        return value

    def string(self) -> str:
        n = self.read("Q")
        raw = bytes(self.buf[self.pos:self.pos + n])
        if len(raw) != n:
            raise ValueError("truncated string")
        self.pos += n
        return raw.decode("utf-8", errors="replace")

    def value(self, kind: int, keep: bool) -> Any:
        """Reads (keep) or skips one value of GGUF type `kind`."""
        if kind in _SCALARS:
            return self.read(_SCALARS[kind])
        if kind == _STRING:
            if keep:
                return self.string()
            n = self.read("Q")  # read first: `self.pos += self.read(...)` loses the 8 bytes
            self.pos += n
            return None
        if kind == _ARRAY:
            inner, count = self.read("I"), self.read("Q")
            if inner in _SCALARS:  # skip a numeric array in one jump
                self.pos += count * struct.calcsize(_SCALARS[inner])
                return None
            for _ in range(count):
                self.value(inner, keep=False)
            return None
        raise ValueError(f"unknown GGUF value type {kind}")


def _gguf_info(path: Path) -> tuple[str | None, int, str | None]:
    """(architecture, parameter count, most common tensor type) from a GGUF header."""
    from gguf import GGMLQuantizationType
    with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        cur = _Cursor(buf)
        if bytes(buf[:4]) != b"GGUF":
            raise ValueError("not a GGUF file (bad magic)")
        cur.pos = 4
        version = cur.read("I")
        if version < 2:
            raise ValueError(f"GGUF version {version} is too old")
        n_tensors, n_kv = cur.read("Q"), cur.read("Q")
        arch = None
        for _ in range(n_kv):
            key = cur.string()
            kind = cur.read("I")
            value = cur.value(kind, keep=key == "general.architecture")
            if key == "general.architecture":
                arch = value
        params = 0
        types: collections.Counter[str] = collections.Counter()
        for _ in range(n_tensors):
            name = cur.string()
            dims = [cur.read("Q") for _ in range(cur.read("I"))]
            kind = cur.read("I")
            cur.read("Q")  # data offset
            if name in _NOT_PARAMS:
                continue
            n = math.prod(dims)
            params += n
            try:
                types[GGMLQuantizationType(kind).name] += n
            except ValueError:
                types[f"type{kind}"] += n
    return arch, params, types.most_common(1)[0][0] if types else None


# ---- Hugging Face ------------------------------------------------------------------------
def _safetensors_header(path: Path) -> dict[str, Any]:
    with path.open("rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n > 100 << 20:
            raise ValueError(f"{path.name}: implausible safetensors header of {n} bytes")
        return json.loads(f.read(n))


def _hf_info(path: Path) -> tuple[str | None, int | None, str | None]:
    """(model_type, parameter count, dtype) from config.json and the safetensors headers."""
    # lazy, as every heavy import here: listing checkpoints loads no model code (`metrale models`)
    from metrale_jax.weights.safetensors_reader import safetensors_files
    cfg = json.loads((path / "config.json").read_text())
    arch = cfg.get("model_type") or (cfg.get("architectures") or [None])[0]
    params = 0
    dtypes: collections.Counter[str] = collections.Counter()
    for file in safetensors_files(path):
        for name, entry in _safetensors_header(file).items():
            if name == "__metadata__":
                continue
            n = math.prod(entry["shape"])
            params += n
            dtypes[entry["dtype"]] += n
    dtype = dtypes.most_common(1)[0][0] if dtypes else cfg.get("torch_dtype") or cfg.get("dtype")
    return arch, params, dtype


def _lora_info(path: Path) -> tuple[str | None, int | None, str | None]:
    """("lora r=R of BASE", parameter count, dtype) of a PEFT LoRA adapter folder."""
    cfg = json.loads((path / "adapter_config.json").read_text())
    base = cfg.get("base_model_name_or_path") or "?"
    params, dtypes = 0, collections.Counter()
    weights = path / "adapter_model.safetensors"
    if weights.is_file():
        for name, entry in _safetensors_header(weights).items():
            if name != "__metadata__":
                n = math.prod(entry["shape"])
                params += n
                dtypes[entry["dtype"]] += n
    kind = str(cfg.get("peft_type", "LORA")).lower()
    return (f"{kind} r={cfg.get('r')} of {Path(str(base)).name}", params,
            dtypes.most_common(1)[0][0] if dtypes else None)


# ---- Metrale (orbax) ---------------------------------------------------------------------
def _orbax_info(path: Path) -> tuple[str | None, int | None, str | None]:
    """(architecture, parameter count, dtype) from metrale.json and the model's shapes. A
    quantized checkpoint counts its float model's parameters (not packed elements and
    scales), and its dtype names the quantization too (e.g. "float32, int4")."""
    import dataclasses

    import jax
    import jax.numpy as jnp

    from metrale_jax.config import ModelConfig
    from metrale_jax.models.transformer import abstract_model  # JAX only when sizing orbax
    meta = json.loads((path / "metrale.json").read_text())
    config = ModelConfig.from_dict(meta["config"])
    dtype = meta.get("dtype")
    _, abstract = abstract_model(dataclasses.replace(config, quantization=None),
                                 jnp.bfloat16 if dtype == "bfloat16" else jnp.float32)
    params = sum(math.prod(x.shape) for x in jax.tree.leaves(abstract))
    if config.quantization:
        dtype = f"{dtype}, {config.quantization}"
    return config.architecture, params, dtype
