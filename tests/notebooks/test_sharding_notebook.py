"""The sharding notebook runs end to end on 8 fake CPU devices with the default model."""

from __future__ import annotations

import pytest

from tests.notebooks.runner import run_notebook


@pytest.mark.default_model
@pytest.mark.slow
def test_sharding_runs(default_gguf, tmp_path):
    run_notebook("sharding.ipynb", tmp_path)
