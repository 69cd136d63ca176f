"""The sharding notebook runs end to end on 8 fake CPU devices.

Its point is where arrays live, not what a model says, so it runs on a tiny random Llama with
8 query heads and 4 kv heads (its `MODEL` parameter): on the notebook's data=2, model=4 mesh
the heads and kv heads really split over the model axis (the default model's 9 / 3 heads stay
replicated there), and its programs compile in seconds instead of minutes.
"""

from __future__ import annotations

import pytest

from devtools.hf_models import build_tiny_checkpoint
from tests.notebooks.runner import run_notebook

SHARDED_HEADS = dict(num_attention_heads=8, num_key_value_heads=4, num_hidden_layers=2)


@pytest.mark.slow
def test_sharding_runs(tmp_path):
    model = build_tiny_checkpoint(tmp_path / "tiny-h8", overrides=SHARDED_HEADS)
    run_notebook("sharding.ipynb", tmp_path, parameters={"MODEL": str(model)})
