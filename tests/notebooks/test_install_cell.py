"""The notebooks' first cell (install Metrale-JAX, pull the default model) run as a script:
from a clone it uses the checkout; outside a clone, with nothing installed and no
METRALE_SOURCE, it stops with a message that says what to set."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.notebooks.runner import NOTEBOOKS, read_notebook


def install_cell(name: str) -> str:
    """The source of the first code cell of `notebooks/<name>`."""
    return next(c for c in read_notebook(name).cells if c.cell_type == "code").source


def run_cell(source: str, cwd, *python_flags: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "METRALE_SOURCE"}
    return subprocess.run([sys.executable, *python_flags, "-c", source], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("name", ["quickstart.ipynb", "sharding.ipynb"])
def test_in_a_clone_the_installed_checkout_is_used(name, default_gguf):
    r = run_cell(install_cell(name), NOTEBOOKS)
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"the checkout {NOTEBOOKS.parent} is installed already" in r.stdout
    assert str(default_gguf) in r.stdout  # `metrale pull` found the model in the clone


@pytest.mark.parametrize("name", ["quickstart.ipynb", "sharding.ipynb"])
def test_outside_a_clone_without_a_source_the_cell_says_what_to_set(name, tmp_path):
    # -S: no site-packages, so metrale_jax is not installed (as on a fresh Colab runtime)
    r = run_cell(install_cell(name), tmp_path, "-S")
    assert r.returncode != 0
    assert "METRALE_SOURCE" in r.stderr and "git URL" in r.stderr
    assert "pip" not in r.stdout  # nothing was installed
