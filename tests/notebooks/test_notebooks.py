"""The notebooks are stored without outputs, and the quickstart runs end to end on CPU (a real
kernel; see `runner.py`). The sharding notebook has its own file so that the two runs can go
to different xdist workers.

The quickstart runs on a tiny random Llama (its `MODEL` parameter), as the sharding notebook
does: its point here is that every cell runs (the Python API, the server, the `openai`
client, the load generator and the plot), and a tiny model's programs compile in seconds,
where the default model's take minutes on this 2-core machine at every cold run. What the
default model itself answers is tested by the "default-model" group (tests/conftest.py) on
the same shapes: its greedy tokens against transformers, a chat answer, a JSON-schema answer
and `metrale serve`.
"""

from __future__ import annotations

import pytest

from tests.hf_models import build_tiny_checkpoint
from tests.notebooks.runner import read_notebook, run_notebook


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


@pytest.mark.slow
def test_quickstart_runs(tmp_path):
    model = build_tiny_checkpoint(tmp_path / "tiny")
    run_notebook("quickstart.ipynb", tmp_path, parameters={"MODEL": str(model)})
