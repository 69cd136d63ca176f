"""The wheels an offline accelerator host lacks: fetched here, installed there (stdlib only).

    python -m bench.device_wheels download --python-version 3.12 --dest wheels/device
    python -m bench.device_wheels install --wheels wheels/device --target build/device-site

A lent TPU or GPU host may have no network. It brings its own Python with JAX and the
packages in `HOST_HAS`; `download` fetches (on a machine with the registries) the wheels of
the project's other runtime dependencies (pyproject.toml's `dependencies`, with their own
dependencies), pure Python or manylinux x86-64 for the host's Python version, drops those
the host brings, and checks that the folder stays within `LIMIT_MIB`. `install` installs,
with no index, the wheels whose projects the running Python lacks into a folder of their
own (`--target`, put on PYTHONPATH), so the host's environment is left as it is.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import re
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIMIT_MIB = 64
HOST_HAS = ("jax", "jaxlib", "flax", "orbax-checkpoint", "transformers", "tokenizers",
            "safetensors", "sentencepiece", "huggingface-hub", "prometheus-client", "httpx",
            "pytest", "numpy")
"""What an accelerator host brings (a GPU host seen: jax/jaxlib 0.11.2 with the CUDA 13
plugin, and these); numpy is assumed (JAX needs it)."""
EXTRA = ("pytest-timeout",)
"""Test plugins the accelerator subset uses beyond the host's pytest (the suite's watchdog)."""
PLATFORMS = ("manylinux2014_x86_64", "manylinux_2_17_x86_64", "manylinux_2_28_x86_64",
             "manylinux_2_31_x86_64")
"""Linux x86-64 with glibc 2.31 or newer (llguidance 1.9's wheel is manylinux_2_31; Ubuntu
22.04 has 2.35, Debian 12 2.36, the Cloud TPU VM images 2.35)."""


def normalize(name: str) -> str:
    """A project name in PEP 503's normal form ("Quart_CORS" -> "quart-cors")."""
    return re.sub(r"[-_.]+", "-", name).lower()


def wanted_requirements(pyproject: Path = ROOT / "pyproject.toml") -> list[str]:
    """pyproject's runtime requirements (with their version specifiers) whose projects are
    not in `HOST_HAS`, plus `EXTRA`."""
    deps = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    host = {normalize(n) for n in HOST_HAS}
    out = [d for d in deps if normalize(re.split(r"[<>=!~\[; ]", d, maxsplit=1)[0]) not in host]
    return out + list(EXTRA)


def wheel_project(path: Path) -> str:
    """The normalized project name of a wheel file name."""
    return normalize(path.name.split("-", 1)[0])


def folder_mib(folder: Path) -> float:
    """Total size of the files in `folder`, in MiB."""
    return sum(p.stat().st_size for p in folder.iterdir() if p.is_file()) / 2**20


def download(python_version: str, dest: Path) -> int:
    """Fetches the wheels into `dest` (emptied first), drops the host's, checks the size.
    Returns the exit status (1 when over `LIMIT_MIB`)."""
    dest.mkdir(parents=True, exist_ok=True)
    for old in dest.glob("*.whl"):
        old.unlink()
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--only-binary=:all:",
           "--python-version", python_version, "--implementation", "cp", "--dest", str(dest)]
    for platform in PLATFORMS:
        cmd += ["--platform", platform]
    reqs = wanted_requirements()
    print("device-wheels: pip download for Python", python_version, ":", " ".join(reqs))
    subprocess.run(cmd + reqs, check=True)
    host = {normalize(n) for n in HOST_HAS}
    for wheel in sorted(dest.glob("*.whl")):
        if wheel_project(wheel) in host:
            print(f"device-wheels: dropped {wheel.name} (the host brings it)")
            wheel.unlink()
    wheels = sorted(dest.glob("*.whl"))
    size = folder_mib(dest)
    print(f"device-wheels: {len(wheels)} wheels in {dest}, {size:.1f} MiB "
          f"(limit {LIMIT_MIB} MiB)")
    for wheel in wheels:
        print(f"  {wheel.stat().st_size / 2**20:6.2f} MiB  {wheel.name}")
    if size > LIMIT_MIB:
        print(f"device-wheels: {size:.1f} MiB is over the {LIMIT_MIB} MiB that travels with "
              "the tree", file=sys.stderr)
        return 1
    print(f"device-wheels: within the {LIMIT_MIB} MiB limit")
    return 0


def missing_projects(wheels: Path) -> list[str]:
    """The projects of the wheels in `wheels` that the running Python has not installed."""
    out = []
    for wheel in sorted(wheels.glob("*.whl")):
        name = wheel_project(wheel)
        try:
            importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            out.append(name)
    return sorted(set(out))


def install(wheels: Path, target: Path) -> int:
    """Installs the missing projects' wheels from `wheels` into `target` (no index, no
    dependency resolution: the folder holds the closure). Returns the exit status."""
    if not wheels.is_dir():
        print(f"device-wheels: no wheel folder {wheels}; run `make device-wheels` on a machine "
              "with the registries and copy it here (continuing with what is installed)")
        return 0
    missing = missing_projects(wheels)
    if not missing:
        print("device-wheels: every project of", wheels, "is installed already")
        return 0
    print("device-wheels: installing into", target, ":", " ".join(missing))
    if subprocess.run([sys.executable, "-m", "pip", "--version"],
                      capture_output=True).returncode != 0:
        return unpack(wheels, target, missing)
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps",
           "--find-links", str(wheels), "--target", str(target), "--upgrade", *missing]
    return subprocess.run(cmd).returncode


def unpack(wheels: Path, target: Path, projects: list[str]) -> int:
    """Where the host's Python has no pip: unzips the wheels of `projects` into `target` (a
    wheel is a zip of its site-packages files; none of these needs its install scripts)."""
    target.mkdir(parents=True, exist_ok=True)
    for wheel in sorted(wheels.glob("*.whl")):
        if wheel_project(wheel) in projects:
            with zipfile.ZipFile(wheel) as z:
                z.extractall(target)
    print("device-wheels: no pip here: unpacked the wheels into", target)
    return 0


def main(argv: list[str] | None = None) -> int:
    """The command line (see the module docstring)."""
    p = argparse.ArgumentParser(prog="python -m bench.device_wheels", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("download", help="fetch the wheels (needs the registries)")
    d.add_argument("--python-version", default="3.12", help="the host's Python (default 3.12)")
    d.add_argument("--dest", type=Path, default=ROOT / "wheels" / "device")
    i = sub.add_parser("install", help="install the missing ones, offline")
    i.add_argument("--wheels", type=Path, default=ROOT / "wheels" / "device")
    i.add_argument("--target", type=Path, default=ROOT / "build" / "device-site")
    args = p.parse_args(argv)
    if args.cmd == "download":
        return download(args.python_version, args.dest)
    return install(args.wheels, args.target)


if __name__ == "__main__":
    sys.exit(main())
