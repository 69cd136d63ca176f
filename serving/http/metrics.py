"""Prometheus metrics under vLLM's names with a `metrale:` prefix, one registry per app.

Counters and histograms are updated by the request handlers; the gauges of slots, queue and
compiles are read from the scheduler at scrape time (a custom collector), so they are never
stale.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from serving.http.stats import loop_problem

PREFIX = "metrale:"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                60.0, 120.0, 240.0, 480.0, 960.0)


class _SchedulerCollector(Collector):
    """Gauges read from `snapshot()` of the scheduler at scrape time."""

    def __init__(self, runtime: Callable[[], Any]):
        self._runtime = runtime

    def collect(self) -> Iterator[Any]:
        runtime = self._runtime()
        scheduler = getattr(runtime, "scheduler", None)
        snap = scheduler.snapshot() if scheduler is not None else {"slots": [], "waiting": 0}
        used = sum(1 for s in snap["slots"] if s is not None)
        total = len(snap["slots"]) or getattr(runtime.settings, "max_slots", 0)
        compiles = scheduler.engine.compile_count if scheduler is not None else 0
        pooler = getattr(runtime, "pooler", None)
        if pooler is not None:  # an embedding model's own programs (or its engine's)
            compiles = pooler.compile_count

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            return GaugeMetricFamily(PREFIX + name, doc, value=value)

        yield gauge("num_requests_running", "Requests in decode slots.", used)
        yield gauge("num_requests_waiting", "Requests waiting for a slot.", snap["waiting"])
        yield gauge("slots_used", "Decode slots in use.", used)
        yield gauge("slots_total", "Decode slots of the engine.", total)
        yield CounterMetricFamily(PREFIX + "compiles", "Programs compiled by the engine.",
                                  value=compiles)
        stats = snap.get("stats", {})
        yield CounterMetricFamily(PREFIX + "num_preemptions",
                                  "Sequences preempted (pages freed, recomputed later) when the "
                                  "KV page pool ran dry.", value=stats.get("preempted", 0))
        yield CounterMetricFamily(PREFIX + "num_preemptions_by_priority",
                                  "Sequences preempted (recomputed later) to make room for a "
                                  "request of a better priority.",
                                  value=stats.get("preempted_by_priority", 0))
        yield CounterMetricFamily(PREFIX + "prefix_cache_queries",
                                  "Prompt tokens looked up in the prefix cache.",
                                  value=stats.get("prefix_cache_queries", 0))
        yield CounterMetricFamily(PREFIX + "prefix_cache_hits",
                                  "Prompt tokens found in the prefix cache (not prefilled).",
                                  value=stats.get("prefix_cache_hits", 0))
        yield CounterMetricFamily(PREFIX + "spec_decode_num_draft_tokens",
                                  "Draft tokens proposed by prompt lookup (speculative "
                                  "decoding).", value=stats.get("spec_drafted", 0))
        yield CounterMetricFamily(PREFIX + "spec_decode_num_accepted_tokens",
                                  "Draft tokens accepted by the verify steps.",
                                  value=stats.get("spec_accepted", 0))
        yield CounterMetricFamily(PREFIX + "stalls", "Stalls of the batching loop (no step "
                                  "completed for the stall timeout with work pending).",
                                  value=stats.get("stalls", 0))
        yield CounterMetricFamily(PREFIX + "step_failures", "Steps whose launch or output "
                                  "raised (their requests failed).",
                                  value=stats.get("step_failures", 0))
        yield gauge("unhealthy", "1 while the batching loop is stalled or failing (/health "
                    "503), else 0.", float(loop_problem(scheduler)
                                           is not None))
        yield from _router_counters(scheduler)
        pages = getattr(scheduler.engine, "pages", None) if scheduler is not None else None
        cache = getattr(pages, "cache", None)
        yield gauge("prefix_cache_pages", "KV pages in the prefix cache (shared or idle).",
                    len(cache) if cache is not None else 0)
        usage = 0.0 if pages is None else 1 - pages.free_pages / pages.usable_pages
        yield gauge("kv_cache_usage_perc", "Fraction of the KV page pool held by sequences.",
                    usage)
        times = getattr(scheduler, "step_times", None)
        yield gauge("max_itl_ms", "The latency target a step beside decoding rows is sized "
                    "to (ms; 0: none).", (times.target_ms or 0.0) if times is not None else 0.0)


def _router_counters(scheduler: Any) -> Iterator[Any]:
    """A mixture-of-experts model's tokens routed per layer and expert since start
    (`Engine.router_counts`), one counter sample per (layer, expert); nothing for a dense
    model."""
    counts_of = getattr(getattr(scheduler, "engine", None), "router_counts", None)
    counts = counts_of() if callable(counts_of) else None
    if counts is None:
        return
    family = CounterMetricFamily(PREFIX + "moe_expert_tokens",
                                 "Tokens routed to each expert of each mixture-of-experts "
                                 "layer (each token counts once for each of its k experts).",
                                 labels=["layer", "expert"])
    for layer, row in enumerate(counts):
        for expert, value in enumerate(row):
            family.add_metric([str(layer), str(expert)], int(value))
    yield family


class _ModelsCollector(Collector):
    """Per-model gauges and counters of the model pool, read at scrape time from
    `ModelPool.rows()` (serving/http/model_pool.py)."""

    def __init__(self, rows: Callable[[], list[dict[str, Any]]]):
        self._rows = rows

    def collect(self) -> Iterator[Any]:
        from serving.http.model_pool import STATES
        rows = self._rows()
        state = GaugeMetricFamily(PREFIX + "model_state", "1 for each model's state in the "
                                  "pool (on_disk, loading, loaded, unloading, sleeping, waking, "
                                  "failed), 0 for the others.", labels=["model", "state"])
        memory = GaugeMetricFamily(PREFIX + "model_memory_bytes", "Bytes per device a model "
                                   "holds (its memory plan: params, KV pool, scratch); 0 when "
                                   "not loaded.", labels=["model"])
        host = GaugeMetricFamily(PREFIX + "model_host_bytes", "Bytes a sleeping model keeps "
                                 "on the host (its params).", labels=["model"])
        active = GaugeMetricFamily(PREFIX + "model_requests_active", "Requests holding each "
                                   "model.", labels=["model"])
        requests = CounterMetricFamily(PREFIX + "model_requests", "Requests served by each "
                                       "model.", labels=["model"])
        loads = CounterMetricFamily(PREFIX + "model_loads", "Loads of each model (start, on "
                                    "demand, admin).", labels=["model"])
        for row in rows:
            name = row["id"]
            for value in STATES:
                state.add_metric([name, value], float(row["state"] == value))
            memory.add_metric([name], row["memory_bytes"])
            host.add_metric([name], row["host_bytes"])
            active.add_metric([name], row["in_flight"])
            requests.add_metric([name], row["requests"])
            loads.add_metric([name], row["loads"])
        yield from (state, memory, host, active, requests, loads)


class Metrics:
    """The app's metrics, in their own `CollectorRegistry` (several apps per process are ok).
    runtime: the primary model's runtime (the scheduler gauges); models: the model pool's rows
    (the per-model gauges), or None."""

    def __init__(self, runtime: Callable[[], Any],
                 models: Callable[[], list[dict[str, Any]]] | None = None):
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests_active = Gauge(PREFIX + "requests_active",
                                     "Generation requests accepted and not yet answered.",
                                     registry=r)
        self.request_success = Counter(PREFIX + "request_success",
                                       "Finished generations, by finish reason.",
                                       ["finished_reason"], registry=r)
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prefilled prompt tokens.",
                                     registry=r)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Generated tokens.",
                                         registry=r)
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds",
                              "Time from arrival to the first generated token.",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram(PREFIX + "time_per_output_token_seconds",
                              "Time between consecutive generated tokens.",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds",
                             "Time from arrival to the last byte of the answer.",
                             buckets=_E2E_BUCKETS, registry=r)
        r.register(_SchedulerCollector(runtime))
        if models is not None:
            r.register(_ModelsCollector(models))

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)
