"""GET /v1/metrale/stats: the server's live state as JSON, for `metrale top` and scripts.

    {"model", "quantization" (None, "int8" or "int8-all": the weights), "state", "uptime_s",
     "time",
     "slots": {"total", "used", "running": [{"slot", "request_id", "tenant", "prompt_tokens",
                                             "tokens", "running_s", "tokens_per_s"}]},
     "waiting", "requests_active", "compiles",
     "health": null, or why the batching loop is unhealthy (/health's 503 reason),
     "counters": {"admitted", "finished", "steps", "tokens", "loop_errors", "preempted",
                  "prefix_cache_queries", "prefix_cache_hits", "spec_drafted",
                  "spec_accepted" (speculative decoding's draft tokens proposed, accepted),
                  "stalls" (the watchdog's), "step_failures" (steps whose launch or output
                  raised), "step_failed_requests" (requests they failed)},
     "prefix_cache": {"enabled", "hit_rate" (hit / queried prompt tokens; None before any),
                      "pages" (cached pages), "idle_pages" (cached, held by no request),
                      "in_use_pages" (held by sequences), "usable_pages" (the pool)},
     "errors": {"total", "by_status": {"400": n, ...},
                "recent": [{"time", "status", "type", "message", "request_id"}]},
     "tenants": null without API keys, else {tenant: {"keys", "enabled_keys",
                "max_concurrent", "running" (slots held), "waiting"}},
     "moe": null for a dense model, else {"expert_tokens": [[tokens routed to each expert]
            per layer] (since start), "imbalance": [per layer, the busiest expert's tokens
            over the mean; 1.0 is even, None before any token]},
     "latency": null before the loop starts, else the latency target and the step-time model
            (`StepTimes.report`): {"max_itl_ms" (null: none), "floor_ms",
            "context_s_per_gflop", "shapes": [{"rows", "chunk", "late",
            "measured_at_warmup_ms", "predicted_ms", "actual_ms", "steps"}]}}

Tenants, never keys: the stats name who is calling, and an admin key is needed to read them
when keys are configured (serving/http/access.py).

`slots.running` comes from `Scheduler.snapshot()` (read without pausing the loop); `tokens`
in `counters` counts every generated token, so a poller gets live throughput from two reads.
Errors are the HTTP error answers (status ≥ 400) and errors sent inside a stream, newest last.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Any

RECENT_ERRORS = 20
COUNTERS = ("admitted", "finished", "steps", "tokens", "loop_errors", "preempted",
            "preempted_by_priority",
            "prefix_cache_queries", "prefix_cache_hits", "spec_drafted", "spec_accepted",
            "stalls", "step_failures", "step_failed_requests")


class ErrorLog:
    """Counts error answers by status and keeps the latest few (thread-safe)."""

    def __init__(self, keep: int = RECENT_ERRORS):
        self._lock = threading.Lock()
        self.total = 0
        self.by_status: collections.Counter[int] = collections.Counter()
        self.recent: collections.deque[dict[str, Any]] = collections.deque(maxlen=keep)

    def record(self, status: int, error_type: str, message: str,
               request_id: str | None = None) -> None:
        """Notes one error answer."""
        with self._lock:
            self.total += 1
            self.by_status[status] += 1
            self.recent.append({"time": time.time(), "status": status, "type": error_type,
                                "message": message, "request_id": request_id})

    def to_dict(self) -> dict[str, Any]:
        """{"total", "by_status", "recent"} (copies)."""
        with self._lock:
            return {"total": self.total,
                    "by_status": {str(k): v for k, v in sorted(self.by_status.items())},
                    "recent": list(self.recent)}


def _running(slots: list[dict[str, Any] | None]) -> list[dict[str, Any]]:
    out = []
    for i, s in enumerate(slots):
        if s is None:
            continue
        running = s.get("running_s")
        rate = s["tokens"] / running if running else None
        out.append({"slot": i, "request_id": s["request_id"], "tenant": s.get("tenant"),
                    "prompt_tokens": s.get("prompt_tokens"), "tokens": s["tokens"],
                    "running_s": running, "tokens_per_s": rate})
    return out


def stats_body(state: Any) -> dict[str, Any]:
    """The stats JSON of a `ServerState` (valid in every runtime state, loading included)."""
    rt = state.runtime
    scheduler = rt.scheduler  # None until warmup starts; then its compiles show the progress
    if scheduler is not None:
        snap = scheduler.snapshot()
        slots, waiting, counters = snap["slots"], snap["waiting"], snap["stats"]
        compiles = scheduler.engine.compile_count
        compiling = scheduler.engine.compile_status()["background"]
    else:
        slots, waiting, counters, compiles = [], 0, {}, 0
        compiling = {"done": 0, "total": 0, "complete": False, "seconds": 0.0}
    if getattr(rt, "pooler", None) is not None:  # an embedding model's own programs
        compiles = rt.pooler.compile_count
    running = _running(slots)
    tenants = state.access.tenants()
    if tenants is not None:
        waiting_by = snap.get("waiting_by_tenant", {}) if scheduler is not None else {}
        for name, row in tenants.items():
            row["running"] = sum(1 for r in running if r["tenant"] == name)
            row["waiting"] = int(waiting_by.get(name, 0))
    status = "draining" if state.draining else rt.state
    pages = getattr(scheduler.engine, "pages", None) if scheduler is not None else None
    cache = getattr(pages, "cache", None)
    queried = int(counters.get("prefix_cache_queries", 0))
    prefix_cache = {"enabled": cache is not None,
                    "hit_rate": counters.get("prefix_cache_hits", 0) / queried if queried else None,
                    "pages": len(cache) if cache is not None else 0,
                    "idle_pages": pages.idle_pages if cache is not None else 0,
                    # pages sequences hold (idle cached ones not counted) of the usable pool
                    "in_use_pages": pages.usable_pages - pages.free_pages if pages else 0,
                    "usable_pages": pages.usable_pages if pages is not None else 0}
    return {
        "model": state.settings.model_name,
        "quantization": (scheduler.engine.model_config.quantization
                         if scheduler is not None else None),
        "state": status,
        "uptime_s": time.time() - rt.created,
        "time": time.time(),
        "slots": {"total": len(slots) or state.settings.max_slots, "used": len(running),
                  "running": running},
        "waiting": waiting,
        "requests_active": state.active,
        "compiles": compiles,
        "background_compile": compiling,
        "health": loop_problem(scheduler),
        "counters": {k: int(counters.get(k, 0)) for k in COUNTERS},
        "prefix_cache": prefix_cache,
        "errors": state.errors.to_dict(),
        "tenants": tenants,
        "moe": moe_stats(scheduler.engine if scheduler is not None else None),
        "latency": (scheduler.step_times.report()
                    if getattr(scheduler, "step_times", None) is not None else None),
        "models": state.pool.rows(),
    }


def loop_problem(scheduler: Any) -> str | None:
    """Why a scheduler's batching loop is unhealthy (`LoopHealth.problem`: stalled, steps
    failing, its engine broken); None when healthy or when there is no scheduler."""
    health = getattr(scheduler, "health", None)
    return health.problem if health is not None else None


def moe_stats(engine: Any) -> dict[str, Any] | None:
    """The "moe" entry of the stats: tokens per layer and expert, and each layer's imbalance
    (max / mean); None for a dense model (or no engine yet)."""
    counts_of = getattr(engine, "router_counts", None)
    counts = counts_of() if callable(counts_of) else None
    if counts is None:
        return None
    imbalance = [float(row.max() / row.mean()) if row.sum() else None for row in counts]
    return {"expert_tokens": counts.tolist(), "imbalance": imbalance}
