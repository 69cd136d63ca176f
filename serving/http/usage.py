"""Usage accounting per tenant: Prometheus counters and `GET /v1/metrale/usage`.

`UsageBook.record(...)` takes every finished request (but /health and /metrics) from the
end-of-request hook (serving/http/request_end.py): its tenant, its usage, its status, and the
limit that refused it, if one did. It keeps

- Prometheus counters labelled by tenant: `metrale:tenant_requests_total`,
  `metrale:tenant_prompt_tokens_total`, `metrale:tenant_cached_prompt_tokens_total`,
  `metrale:tenant_completion_tokens_total`, and `metrale:tenant_rejected_requests_total`
  (also labelled by `limit`: requests, tokens, concurrent, daily_tokens). The label's values
  are bounded: the first `max_tenants` tenants seen keep their names, later ones are counted
  as `other` (tenants come from the operator's key file, so this only bites a file with very
  many); requests without a key are `anonymous`.
- the same figures per tenant and per minute for `retention` seconds (7 days by default), and
  totals since the server started, for the usage route: `query(tenant, since)`.

With a usage log (`--usage-log FILE`, serving/http/usage_log.py) every record is also
appended to the file, and a new book reads the file's records within the retention back: the
per-minute figures and the totals then go back to the oldest record kept (`started`), across
restarts and kills. The Prometheus counters count this process's requests only (a restart is
a counter reset, which `rate()` and `increase()` handle).
"""

from __future__ import annotations

import collections
import dataclasses
import math
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from datetime import datetime
from typing import Any

from prometheus_client import CollectorRegistry, Counter

from metrale_jax.errors import InvalidParameterError
from serving.http.errors import RateLimitError
from serving.http.metrics import PREFIX
from serving.http.usage_log import UsageLog

ANONYMOUS = "anonymous"
"""The tenant of requests that carry no key (a server without keys)."""

OTHER = "other"
"""The Prometheus label of tenants past `max_tenants`."""

FIELDS = ("requests", "prompt_tokens", "cached_tokens", "completion_tokens",
          "rejected_requests", "error_requests")
"""What is counted per tenant (`error_requests`: answered with a status ≥ 400, the
rejected ones included)."""


@dataclasses.dataclass
class Tally:
    """One tenant's figures over some time (the `FIELDS`)."""

    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    rejected_requests: int = 0
    error_requests: int = 0

    def add(self, other: Tally) -> None:
        """Adds `other`'s figures to these."""
        for name in FIELDS:
            setattr(self, name, getattr(self, name) + getattr(other, name))

    def as_dict(self) -> dict[str, int]:
        """The figures, with `total_tokens` (prompt + completion)."""
        out = dataclasses.asdict(self)
        out["total_tokens"] = self.prompt_tokens + self.completion_tokens
        return out


def tally_of(usage: Mapping[str, Any], status: int | None, rejected: bool) -> Tally:
    """One request's `Tally` from its OpenAI usage object and HTTP status."""
    details = usage.get("prompt_tokens_details") or {}
    return Tally(requests=1, prompt_tokens=int(usage.get("prompt_tokens", 0)),
                 cached_tokens=int(details.get("cached_tokens", 0) or 0),
                 completion_tokens=int(usage.get("completion_tokens", 0)),
                 rejected_requests=int(rejected),
                 error_requests=int(status is not None and status >= 400))


def parse_since(value: str) -> float:
    """A `since` query value: Unix seconds, or an ISO 8601 time (UTC unless it says
    otherwise). Raises `InvalidParameterError`."""
    try:
        since = float(value)
    except ValueError:
        try:
            stamp = datetime.fromisoformat(value.replace("Z", "+00:00"))
        except ValueError:
            raise InvalidParameterError(
                f"since={value!r}: give Unix seconds or an ISO 8601 time "
                "(2026-12-04T10:00:00Z)", param="since") from None
        if stamp.tzinfo is None:
            from datetime import UTC
            stamp = stamp.replace(tzinfo=UTC)
        since = stamp.timestamp()
    if not math.isfinite(since):
        raise InvalidParameterError(f"since={value!r} is not a time", param="since")
    return since


class UsageBook:
    """Per-tenant usage: Prometheus counters in `registry` and per-minute figures.

    max_tenants: tenants named in the counters' labels (later ones: `other`); retention:
    seconds of per-minute figures kept; clock: Unix seconds (injectable for tests); usage_log:
    where records are appended and read back from at start (None: memory only).
    Thread-safe.
    """

    def __init__(self, registry: CollectorRegistry, max_tenants: int = 64,
                 retention: float = 7 * 86400.0, clock: Callable[[], float] = time.time,
                 usage_log: UsageLog | None = None):
        self.max_tenants = max_tenants
        self.retention = retention
        self.clock = clock
        self.started = clock()
        self.usage_log = usage_log
        self._lock = threading.Lock()
        self._labels: set[str] = set()
        self._totals: dict[str, Tally] = {}
        self._minutes: dict[str, collections.OrderedDict[int, Tally]] = {}
        if usage_log is not None:
            self._read_back(usage_log)
        label = ["tenant"]
        self.requests = Counter(PREFIX + "tenant_requests", "Requests per tenant (all routes "
                                "but /health and /metrics).", label, registry=registry)
        self.prompt_tokens = Counter(PREFIX + "tenant_prompt_tokens",
                                     "Prompt tokens per tenant.", label, registry=registry)
        self.cached_tokens = Counter(PREFIX + "tenant_cached_prompt_tokens",
                                     "Prompt tokens served from the prefix cache, per tenant.",
                                     label, registry=registry)
        self.completion_tokens = Counter(PREFIX + "tenant_completion_tokens",
                                         "Generated tokens per tenant.", label,
                                         registry=registry)
        self.rejected = Counter(PREFIX + "tenant_rejected_requests",
                                "Requests refused by a limit of the key (429), per tenant and "
                                "limit.", ["tenant", "limit"], registry=registry)

    def label(self, tenant: str | None) -> str:
        """The Prometheus label of `tenant` (bounded: `other` past `max_tenants`)."""
        name = tenant if tenant is not None else ANONYMOUS
        with self._lock:
            if name in self._labels:
                return name
            if len(self._labels) < self.max_tenants:
                self._labels.add(name)
                return name
        return OTHER

    def record(self, tenant: str | None, usage: Mapping[str, Any], status: int | None,
               rejected_by: str | None = None) -> None:
        """Counts one finished request. rejected_by: the limit that refused it (a 429), one
        of `RateLimitError.LIMITS`."""
        tally = tally_of(usage, status, rejected_by is not None)
        label = self.label(tenant)
        self.requests.labels(label).inc()
        if tally.prompt_tokens:
            self.prompt_tokens.labels(label).inc(tally.prompt_tokens)
        if tally.cached_tokens:
            self.cached_tokens.labels(label).inc(tally.cached_tokens)
        if tally.completion_tokens:
            self.completion_tokens.labels(label).inc(tally.completion_tokens)
        if rejected_by is not None:
            limit = rejected_by if rejected_by in RateLimitError.LIMITS else OTHER
            self.rejected.labels(label, limit).inc()
        name = tenant if tenant is not None else ANONYMOUS
        now = self.clock()
        self._add(name, now, tally)
        if self.usage_log is not None:
            self.usage_log.append({"t": round(now, 3), "tenant": name,
                                   **dataclasses.asdict(tally)})

    def _add(self, name: str, now: float, tally: Tally) -> None:
        minute = int(now // 60)
        with self._lock:
            self._totals.setdefault(name, Tally()).add(tally)
            minutes = self._minutes.setdefault(name, collections.OrderedDict())
            minutes.setdefault(minute, Tally()).add(tally)
            oldest = int((now - self.retention) // 60)
            while minutes and next(iter(minutes)) < oldest:
                minutes.popitem(last=False)

    def _read_back(self, usage_log: UsageLog) -> None:
        """Adds the log's records within the retention (in time order, per minute) and
        compacts the file to one line per tenant and minute; `started` becomes the oldest
        record's time."""
        now = self.clock()
        kept: dict[tuple[str, int], Tally] = {}
        for record in usage_log.read():
            t = float(record["t"])
            if t < now - self.retention or t > now + 60:
                continue
            tally = Tally(**{k: int(v) for k, v in record.items()
                             if k in FIELDS and isinstance(v, int | float)})
            name = str(record.get("tenant") or ANONYMOUS)
            kept.setdefault((name, int(t // 60)), Tally()).add(tally)
        for (name, minute), tally in sorted(kept.items(), key=lambda kv: kv[0][1]):
            self._add(name, minute * 60.0, tally)
            self.started = min(self.started, minute * 60.0)
        usage_log.rewrite([{"t": minute * 60, "tenant": name, **dataclasses.asdict(tally)}
                           for (name, minute), tally in sorted(kept.items(),
                                                               key=lambda kv: kv[0][1])])

    def tenants(self) -> list[str]:
        """The tenants with recorded usage, sorted."""
        with self._lock:
            return sorted(self._totals)

    def query(self, tenants: Iterable[str], since: float | None = None) -> dict[str, Tally]:
        """Each tenant's figures since `since` (Unix seconds, counted from the start of its
        minute; None: since the server started). Raises `InvalidParameterError` when `since`
        is older than the retention (and than the server's start)."""
        out = {t: Tally() for t in tenants}
        now = self.clock()
        with self._lock:
            if since is None or since <= self.started:
                for t in out:
                    if t in self._totals:
                        out[t].add(self._totals[t])
                return out
            if since < now - self.retention:
                raise InvalidParameterError(
                    f"usage is kept per minute for {self.retention / 3600:g} hours; since "
                    f"must be later than {now - self.retention:.0f} (or before the server's "
                    f"start, {self.started:.0f}, for the totals)", param="since")
            first = int(since // 60)
            for t in out:
                for minute, tally in self._minutes.get(t, {}).items():
                    if minute >= first:
                        out[t].add(tally)
        return out
