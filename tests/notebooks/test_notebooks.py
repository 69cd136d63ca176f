"""The notebooks are stored without outputs, and the quickstart runs end to end on CPU with
the default model (a real kernel; see `runner.py`). The sharding notebook has its own file
so that the two slow runs can go to different xdist workers."""

from __future__ import annotations

import pytest

from tests.notebooks.runner import read_notebook, run_notebook

# The quickstart runs the default model on the default_llm fixture's shapes: in the
# "default-model" group (tests/conftest.py) its programs come from the persistent cache that
# group's other tests fill, rather than being compiled in two processes at once.
pytestmark = pytest.mark.xdist_group("default-model")


@pytest.mark.parametrize("name", ["quickstart.ipynb", "sharding.ipynb"])
def test_notebook_is_stored_without_outputs(name):
    nb = read_notebook(name)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code, "no code cells"
    for cell in code:
        assert cell.outputs == [] and cell.execution_count is None, cell.source[:80]
    assert "METRALE_SOURCE = \"\"" in code[0].source  # the install cell comes first
    params = [c for c in code if "parameters" in c.metadata.get("tags", [])]
    assert len(params) == 1 and 'MODEL = "default"' in params[0].source  # users get it


@pytest.mark.default_model
@pytest.mark.slow
def test_quickstart_runs(default_gguf, tmp_path):
    run_notebook("quickstart.ipynb", tmp_path)
