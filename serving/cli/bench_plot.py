"""`metrale bench --plot FILE.png`: throughput and latency against concurrency (matplotlib).

matplotlib is an optional dependency (the `plot` extra); `available()` says whether it is
installed, so the CLI can refuse `--plot` before running anything.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any


def available() -> bool:
    """True when matplotlib can be imported."""
    return importlib.util.find_spec("matplotlib") is not None


def _ms(rows: list[dict[str, Any]], key: str) -> list[float]:
    return [float("nan") if r.get(key) is None else r[key] * 1e3 for r in rows]


def plot_levels(rows: list[dict[str, Any]], path: str | Path, title: str = "") -> Path:
    """Draws two panels from `summarize` rows and writes them to `path` (PNG); returns it.

    Left: aggregate output tokens/s and requests/s. Right: TTFT and TPOT p50 / p99 in ms.
    The x axis is the concurrency (log 2 when the levels span more than a factor of 4).
    """
    import matplotlib
    matplotlib.use("Agg")  # files only; never a window
    import matplotlib.pyplot as plt

    rows = sorted(rows, key=lambda r: r["concurrency"])
    x = [r["concurrency"] for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2), constrained_layout=True)
    left.plot(x, [r["output_tok_s"] for r in rows], "o-", label="output tok/s")
    left.set_xlabel("concurrency")
    left.set_ylabel("output tokens/s")
    left.set_title("throughput")
    twin = left.twinx()
    twin.plot(x, [r["req_s"] for r in rows], "s--", color="tab:gray", label="requests/s")
    twin.set_ylabel("requests/s")
    lines = left.get_lines() + twin.get_lines()
    left.legend(lines, [line.get_label() for line in lines], loc="upper left")
    for key, style in (("ttft_p50", "o-"), ("ttft_p99", "o:"), ("tpot_p50", "s-"),
                       ("tpot_p99", "s:")):
        right.plot(x, _ms(rows, key), style, label=key.replace("_", " "))
    right.set_xlabel("concurrency")
    right.set_ylabel("ms")
    right.set_title("latency")
    right.legend(loc="upper left")
    if x and max(x) >= 4 * min(x):
        for ax in (left, right):
            ax.set_xscale("log", base=2)
    for ax in (left, right):
        ax.set_xticks(x, [str(c) for c in x])
        ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
