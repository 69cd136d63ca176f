"""What happens when a request has ended: its dump line, its log line and its usage.

`install(state)` adds three end-of-request hooks to `state.access.end_hooks` (each runs once
per request with its finished `RequestContext`, serving/http/context.py):

- the request dump (`--dump-requests DIR`): `dump_entry_of(ctx)` queued on the
  `RequestDumper` (serving/http/dumps.py; written off the event loop);
- the per-tenant usage (`UsageBook`, serving/http/usage.py): Prometheus counters and the
  usage route's figures;
- one INFO log line per request (logger `metrale.requests`): its number or id, method, route,
  status, tenant (never a key), tokens and seconds.

/health and /metrics (`PROBE_PATHS`) are none of these (load balancers and scrapers call them
every few seconds), nor the web page and its assets (`/`, `/webui/...`).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from serving.http.context import RequestContext
from serving.http.dumps import DumpEntry, RequestDumper, dump_entry

log = logging.getLogger("metrale.requests")

PROBE_PATHS = frozenset({"/health", "/metrics", "/"})
"""Routes that are not numbered, dumped, counted per tenant nor logged (with the web page's
assets, under `PAGE_PREFIX`)."""

PAGE_PREFIX = "/webui/"

CLIENT_LEFT = 499
"""The status a dump records for a request whose client left before any answer (nginx's)."""


def is_probe(path: str) -> bool:
    """Whether `path` is a health or metrics probe, or the web page (no API request)."""
    return path in PROBE_PATHS or path.startswith(PAGE_PREFIX)


def _seconds(value: float | None) -> float | None:
    return None if value is None else round(value, 6)


def dump_entry_of(ctx: RequestContext, now: float | None = None) -> DumpEntry:
    """A finished request's dump entry (serving/http/dumps.py's schema): its route, tenant,
    status (499 when its client left before any answer), body, outcome and timings (`now`:
    `time.monotonic()` at its end)."""
    now = time.monotonic() if now is None else now
    gen = ctx.generation
    reasons: list[str | None] = []
    texts: list[str | None] | None = None
    if ctx.outcome is not None:
        reasons, texts = ctx.outcome()
    queue_s = ttft_s = None
    if gen is not None:
        queue_s = gen.queue_seconds
        if gen.first_token_at is not None:
            ttft_s = gen.first_token_at - ctx.started_mono
    error = None
    if ctx.error is not None:
        error = {"type": ctx.error.get("type", ""), "code": ctx.error.get("code"),
                 "message": ctx.error.get("message", "")}
    return dump_entry(
        route=ctx.path, method=ctx.method,
        status=ctx.status if ctx.status is not None else CLIENT_LEFT, body=ctx.body,
        tenant=ctx.tenant, request_id=ctx.request_id, finish_reasons=reasons,
        usage=ctx.usage or {}, error=error, cancelled=ctx.cancelled,
        timed_out=ctx.timed_out, texts=texts, queue_s=_seconds(queue_s),
        ttft_s=_seconds(ttft_s), total_s=_seconds(now - ctx.started_mono))


def log_line(ctx: RequestContext, now: float | None = None) -> None:
    """Logs one INFO line for a finished request (no key, no prompt)."""
    now = time.monotonic() if now is None else now
    usage = ctx.usage or {}
    status: Any = ctx.status if ctx.status is not None else "client left"
    if ctx.cancelled and ctx.status is not None:
        status = f"{ctx.status} (client left)"
    tokens = ""
    if usage:
        tokens = (f" {usage.get('prompt_tokens', 0)}+{usage.get('completion_tokens', 0)} "
                  "tokens")
    tenant = f" tenant={ctx.tenant}" if ctx.tenant is not None else ""
    log.info("%s %s %s %s%s%s %.3f s", ctx.label(), ctx.method, ctx.path, status, tenant,
             tokens, now - ctx.started_mono)


def install(state: Any) -> None:
    """Adds the dump, usage and log hooks to `state.access.end_hooks` (the dump hook only
    when `state.dumper` is set)."""
    dumper: RequestDumper | None = state.dumper

    def end(ctx: RequestContext) -> None:
        if is_probe(ctx.path):
            return
        now = time.monotonic()
        if dumper is not None and ctx.seq is not None:
            dumper.record(ctx.seq, dump_entry_of(ctx, now))
        rejected = ctx.error.get("limit") if ctx.error is not None else None
        state.usage.record(ctx.tenant, ctx.usage or {}, ctx.status, rejected)
        log_line(ctx, now)

    state.access.end_hooks.append(end)
