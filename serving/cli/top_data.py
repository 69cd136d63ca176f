"""What `metrale top` shows, apart from drawing it: polls, derived series and text rows.

Each poll reads `GET /v1/metrale/stats` (slots, queue, counters, errors) and `GET /metrics`
(the TTFT histogram and finish reasons). Between two polls, throughput is the growth of the
generated-token counter over the time between them, and TTFT is the mean over the requests
whose first token came in that interval (the histogram's sum and count grow by theirs).
"""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Any

from serving.cli.http_client import Client

PREFIX = "metrale:"
HISTORY = 120
SLOT_COLUMNS = ("slot", "request", "prompt", "tokens", "tok/s", "running")
ERROR_COLUMNS = ("time", "status", "type", "message")
MODEL_COLUMNS = ("model", "state", "in flight", "requests", "memory", "loads", "keep-alive",
                 "idle")


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {"name" or "name{k=v,...}": value} for every sample."""
    from prometheus_client.parser import text_string_to_metric_families
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            key = s.name
            if s.labels:
                key += "{" + ",".join(f"{k}={v}" for k, v in sorted(s.labels.items())) + "}"
            out[key] = float(s.value)
    return out


@dataclasses.dataclass
class Sample:
    """One poll: the stats JSON, the flattened metrics and the client's clock."""

    at: float
    stats: dict[str, Any]
    metrics: dict[str, float]

    @property
    def tokens(self) -> int:
        """Tokens generated since the server started."""
        return int(self.stats.get("counters", {}).get("tokens", 0))

    @property
    def ttft(self) -> tuple[float, float]:
        """(sum of seconds, count) of the TTFT histogram."""
        name = PREFIX + "time_to_first_token_seconds"
        return self.metrics.get(name + "_sum", 0.0), self.metrics.get(name + "_count", 0.0)

    def finished(self) -> dict[str, int]:
        """Finished requests by finish reason."""
        head = PREFIX + "request_success_total{finished_reason="
        return {k[len(head):-1]: int(v) for k, v in self.metrics.items() if k.startswith(head)}


class TopModel:
    """Polls one server and keeps the last `history` points of each series.

    throughput: output tokens/s between consecutive polls. ttft_ms: mean TTFT (ms) of the
    requests that got their first token in each interval (0 where none did).
    """

    def __init__(self, client: Client, history: int = HISTORY):
        self.client = client
        self.throughput: collections.deque[float] = collections.deque(maxlen=history)
        self.ttft_ms: collections.deque[float] = collections.deque(maxlen=history)
        self.last: Sample | None = None

    def fetch(self) -> Sample:
        """Reads both endpoints once (raises `UnreachableError` or `APIError`)."""
        stats = self.client.get_json("/v1/metrale/stats")
        metrics = parse_metrics(self.client.get_text("/metrics"))
        return Sample(time.monotonic(), stats, metrics)

    def poll(self) -> Sample:
        """Fetches a sample and extends the series with the interval since the last one."""
        sample = self.fetch()
        self.add(sample)
        return sample

    def add(self, sample: Sample) -> None:
        """Extends the series with the interval from the previous sample to `sample`."""
        prev, self.last = self.last, sample
        if prev is None:
            return
        dt = sample.at - prev.at
        if dt <= 0:
            return
        self.throughput.append(max(0, sample.tokens - prev.tokens) / dt)
        (s1, n1), (s0, n0) = sample.ttft, prev.ttft
        self.ttft_ms.append((s1 - s0) / (n1 - n0) * 1e3 if n1 > n0 else 0.0)


def _seconds(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v:.1f} s" if v < 120 else f"{v / 60:.0f} min"


def summary(stats: dict[str, Any], model: TopModel | None = None) -> list[str]:
    """The dashboard's summary lines."""
    slots = stats.get("slots", {})
    errors = stats.get("errors", {})
    counters = stats.get("counters", {})
    lines = [f"{stats.get('model', '?')}  state {stats.get('state', '?')}  "
             f"up {_seconds(stats.get('uptime_s'))}",
             f"slots {slots.get('used', 0)}/{slots.get('total', 0)}  "
             f"waiting {stats.get('waiting', 0)}  active requests "
             f"{stats.get('requests_active', 0)}  compiles {stats.get('compiles', 0)}",
             f"finished {counters.get('finished', 0)}  tokens {counters.get('tokens', 0)}  "
             f"errors {errors.get('total', 0)}"
             + (f" (loop {counters['loop_errors']})" if counters.get("loop_errors") else "")]
    compiling = stats.get("background_compile") or {}
    if compiling.get("total") and not compiling.get("complete"):
        lines.append(f"compiling the grid in the background  {compiling.get('done', 0)}/"
                     f"{compiling['total']} programs  {_seconds(compiling.get('seconds'))}")
    cache = stats.get("prefix_cache") or {}
    if cache.get("enabled"):
        rate = cache.get("hit_rate")
        lines.append(f"prefix cache  hit rate {'-' if rate is None else f'{rate:.0%}'}  "
                     f"pages {cache.get('pages', 0)} ({cache.get('idle_pages', 0)} idle)")
    if model is not None and model.throughput:
        ttft = [v for v in model.ttft_ms if v > 0]
        lines.append(f"now {model.throughput[-1]:.1f} tok/s  peak {max(model.throughput):.1f}"
                     + (f"  last TTFT {ttft[-1]:.0f} ms" if ttft else ""))
    return lines


def slot_rows(stats: dict[str, Any]) -> list[tuple[str, ...]]:
    """One row per busy slot: slot, request id, prompt tokens, tokens, tokens/s, running."""
    rows = []
    for s in stats.get("slots", {}).get("running", []):
        rate = s.get("tokens_per_s")
        rows.append((str(s["slot"]), str(s["request_id"]), str(s.get("prompt_tokens", "-")),
                     str(s["tokens"]), "-" if rate is None else f"{rate:.1f}",
                     _seconds(s.get("running_s"))))
    return rows


def _bytes(n: int) -> str:
    return "-" if not n else f"{n / 2**20:.0f} MiB" if n < 2**30 else f"{n / 2**30:.2f} GiB"


def model_rows(stats: dict[str, Any]) -> list[tuple[str, ...]]:
    """One row per servable model (the model pool's): name, state, requests in flight and
    served, memory per device (a sleeping model: its host copy, in brackets), loads,
    keep-alive and idle time."""
    rows = []
    for m in stats.get("models") or []:
        memory = _bytes(m["memory_bytes"]) if m["memory_bytes"] or not m.get("host_bytes") \
            else f"({_bytes(m['host_bytes'])} host)"
        keep = m.get("keep_alive")
        rows.append((str(m["id"]), str(m["state"]), str(m["in_flight"]), str(m["requests"]),
                     memory, str(m["loads"]), "forever" if keep == -1 else _seconds(keep),
                     _seconds(m.get("idle_seconds"))))
    return rows


def error_rows(stats: dict[str, Any], limit: int = 8) -> list[tuple[str, ...]]:
    """The latest errors, newest first: time, status, type, message."""
    recent = stats.get("errors", {}).get("recent", [])[-limit:]
    return [(time.strftime("%H:%M:%S", time.localtime(e["time"])), str(e["status"]),
             str(e["type"]), str(e["message"])[:200]) for e in reversed(recent)]


def render_text(stats: dict[str, Any], model: TopModel | None = None) -> str:
    """The whole dashboard as plain text (`metrale top --once`)."""
    out = list(summary(stats, model))
    rows = slot_rows(stats)
    out.append("")
    out.append("  ".join(SLOT_COLUMNS) if rows else "no request in a slot")
    out += ["  ".join(r) for r in rows]
    models = model_rows(stats)
    if len(models) > 1:
        out.append("")
        out.append("  ".join(MODEL_COLUMNS))
        out += ["  ".join(r) for r in models]
    errors = error_rows(stats)
    if errors:
        out.append("")
        out.append("recent errors:")
        out += ["  ".join(e) for e in errors]
    return "\n".join(out)
