"""Multi-device tests on CPU: a test file runs itself as a child process that sees `devices`
fake CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count, set before jax is
imported), and hands its results back as one JSON report line on stdout."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
_REPORT = "REPORT "


def run_child(script: str | Path, arg: str, *, timeout: float, devices: int = 8) -> Any:
    """Runs `python script arg` with `devices` fake CPU devices; asserts it succeeded and
    returns the report it printed with `print_report`."""
    from tests.conftest import xla_flags
    env = {**os.environ, "XLA_FLAGS": xla_flags(devices),
           "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, str(script), arg], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith(_REPORT))
    return json.loads(line[len(_REPORT):])


def print_report(report: Any) -> None:
    """In the child: prints `report` (JSON-serialisable) as the line `run_child` reads."""
    print(_REPORT + json.dumps(report), flush=True)
