"""Runs a notebook of `notebooks/` as stored, in a fresh kernel (nbclient), for the tests.

Every cell runs, the install cell included: the kernel's working directory is the clone's
`notebooks/` folder (where a user opens them), so that cell finds the checkout, sees it is the
one installed in this environment and only runs `metrale pull`. Any cell error fails the
calling test with that cell's traceback.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.conftest import CACHE, REPO, xla_flags

NOTEBOOKS = REPO / "notebooks"
CELL_TIMEOUT = 1200  # seconds: compiling the default model on a busy 2-core machine


def read_notebook(name: str):
    """The stored notebook `notebooks/<name>` as an nbformat v4 node."""
    import nbformat
    return nbformat.read(NOTEBOOKS / name, as_version=4)


def run_notebook(name: str, tmp_path: Path, parameters: dict[str, object] | None = None) -> None:
    """Executes every cell of `notebooks/<name>` on CPU; fails the test on a cell error.

    parameters: values that replace the notebook's defaults, papermill's way: a cell setting
    them is inserted right after the cell tagged "parameters" (which must exist then).
    """
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError
    nb = read_notebook(name)
    if parameters:
        at = next(i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", []))
        source = "\n".join(f"{key} = {value!r}" for key, value in parameters.items())
        nb.cells.insert(at + 1, nbformat.v4.new_code_cell(source))
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "METRALE_JAX_CACHE": str(CACHE), "MPLBACKEND": "Agg",
           "MPLCONFIGDIR": str(tmp_path / "mpl")}
    env["XLA_FLAGS"] = xla_flags()  # no fake devices: the sharding notebook asks for its own
    env.pop("METRALE_SOURCE", None)  # installs from the clone, as a user of the clone does
    client = NotebookClient(nb, timeout=CELL_TIMEOUT, kernel_name="python3",
                            resources={"metadata": {"path": str(NOTEBOOKS)}})
    try:
        client.execute(env=env)
    except CellExecutionError as e:
        pytest.fail(f"{name}: a cell failed:\n{e}")
    for cell in nb.cells:  # executed: every code cell ran and none wrote an error
        if cell.cell_type == "code":
            assert cell.execution_count is not None
            assert not [o for o in cell.outputs if o.output_type == "error"]
