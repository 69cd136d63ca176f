"""A mixture-of-experts engine's router statistics in /metrics (one counter sample per layer
and expert) and in /v1/metrale/stats ("moe": tokens per expert, each layer's imbalance);
nothing for a dense engine."""

from __future__ import annotations

import re
import types

import numpy as np

from serving.http.metrics import Metrics
from serving.http.stats import moe_stats

COUNTS = np.array([[6, 2, 0, 0], [2, 2, 2, 2]], np.int64)


def fake_runtime(counts):
    engine = types.SimpleNamespace(compile_count=3, pages=None,
                                   router_counts=lambda: counts)
    scheduler = types.SimpleNamespace(
        engine=engine, snapshot=lambda: {"slots": [None], "waiting": 0, "stats": {}})
    return types.SimpleNamespace(scheduler=scheduler,
                                 settings=types.SimpleNamespace(max_slots=1))


def test_metrics_count_tokens_per_layer_and_expert():
    text = Metrics(lambda: fake_runtime(COUNTS)).render().decode()
    samples = {(int(layer), int(expert)): float(v) for expert, layer, v in re.findall(
        r'^metrale:moe_expert_tokens_total\{expert="(\d+)",layer="(\d+)"\} (\S+)$', text, re.M)}
    assert samples == {(i, j): float(COUNTS[i, j]) for i in range(2) for j in range(4)}
    dense = Metrics(lambda: fake_runtime(None)).render().decode()
    assert "moe_expert_tokens" not in dense


def test_stats_show_each_layers_imbalance():
    engine = types.SimpleNamespace(router_counts=lambda: COUNTS)
    assert moe_stats(engine) == {"expert_tokens": COUNTS.tolist(), "imbalance": [3.0, 1.0]}
    idle = types.SimpleNamespace(router_counts=lambda: np.zeros((1, 2), np.int64))
    assert moe_stats(idle)["imbalance"] == [None]
    assert moe_stats(types.SimpleNamespace(router_counts=lambda: None)) is None
    assert moe_stats(None) is None
