"""Per-key rate limits and quotas: requests and tokens per minute, concurrent requests and
a daily token quota, with OpenAI's 429 and `x-ratelimit-*` headers.

- Requests per minute and tokens per minute are token buckets of that capacity, refilled
  continuously (capacity / 60 per second), as OpenAI's limits behave: a burst may spend the
  whole minute at once, then the bucket refills. A request takes 1 from the requests bucket
  when it arrives; a generation reserves its prompt plus its most possible completion tokens
  (`max_tokens`, or what the context leaves, for each choice) from the tokens bucket and the
  daily quota once its prompt is tokenized, and `settle` corrects both to the actual usage
  when it ends (the unused reservation goes back; the bucket never exceeds its capacity).
- Concurrent requests: counted from arrival to the end of the answer (a stream's last byte).
- The daily quota counts prompt plus completion tokens per UTC day (it resets at midnight).

Over a limit: 429 `rate_limit_exceeded` with `Retry-After` (seconds, and `retry-after-ms`,
which the openai client reads first): when the bucket will hold what the request needs (a
request larger than the bucket can never pass and says so). Every answer to a keyed request
carries `x-ratelimit-limit-requests`, `-remaining-requests`, `-reset-requests` (time until the
bucket is full again, in OpenAI's format: "1s", "6m0s", "20ms") and the `-tokens` trio, for
each limit the key has: a whole answer's after its usage is settled, a stream's (sent before
it runs) with its reservation taken.

Why not a library: aiolimiter (a leaky bucket), limits (fixed and moving windows) and
pyrate-limiter (windows over buckets) all count hits only: none can give back the unused part
of a reservation, which the tokens-per-minute limit needs at the end of every request; and
their clocks are the wall or loop clock, where tests need one they can advance. A bucket is a
few lines. `Limiter.clock` (seconds since the epoch; time.time by default) is the one clock
every bucket and quota reads: tests replace it.

Thread-safety: everything runs on the server's event loop.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable

from serving.http.errors import RateLimitError
from serving.http.keys import ApiKey, Limits

DAY_S = 86400.0


class TokenBucket:
    """`capacity` tokens, refilled at capacity / `period` per second up to the capacity.

    The level may go below zero when a settlement charges more than was reserved (the
    debt is repaid by the refill)."""

    def __init__(self, capacity: int, now: float, period: float = 60.0):
        self.capacity = capacity
        self.period = period
        self.level = float(capacity)
        self.at = now

    def _seconds(self, tokens: float) -> float:
        return tokens * self.period / self.capacity  # (exact for whole numbers of tokens)

    def refill(self, now: float) -> None:
        """Adds what `now - at` seconds give (a clock going back adds nothing)."""
        if now > self.at:
            self.level = min(self.capacity,
                             self.level + (now - self.at) * self.capacity / self.period)
        self.at = max(self.at, now)

    def wait(self, amount: float, now: float) -> float:
        """Seconds until the bucket holds `amount` (0: now; inf: never, over the capacity)."""
        self.refill(now)
        if amount > self.capacity:
            return math.inf
        return max(0.0, self._seconds(amount - self.level))

    def take(self, amount: float) -> None:
        """Takes `amount` (after a `wait` of 0); a negative amount gives back."""
        self.level = min(self.capacity, self.level - amount)

    def until_full(self, now: float) -> float:
        """Seconds until the bucket is full again (OpenAI's reset)."""
        self.refill(now)
        return max(0.0, self._seconds(self.capacity - self.level))

    def remaining(self, now: float) -> int:
        """Whole tokens in the bucket now."""
        self.refill(now)
        return max(0, math.floor(self.level + 1e-9))


class DailyQuota:
    """`limit` tokens per UTC day."""

    def __init__(self, limit: int):
        self.limit = limit
        self.day = -1
        self.used = 0

    def roll(self, now: float) -> None:
        """Starts a new day's count when the UTC day changed."""
        day = int(now // DAY_S)
        if day != self.day:
            self.day, self.used = day, 0

    def left(self, now: float) -> int:
        """Tokens left today."""
        self.roll(now)
        return self.limit - self.used

    @staticmethod
    def until_reset(now: float) -> float:
        """Seconds until the next UTC midnight."""
        return DAY_S - now % DAY_S


@dataclasses.dataclass
class Reservation:
    """What a request took: the tokens reserved, and the day of the daily quota they count
    in (None: no daily quota)."""

    tokens: int = 0
    day: int | None = None


class KeyLimiter:
    """The live state of one key's limits."""

    def __init__(self, limits: Limits, now: float):
        self.limits = limits
        self.requests = (TokenBucket(limits.requests_per_minute, now)
                         if limits.requests_per_minute else None)
        self.tokens = (TokenBucket(limits.tokens_per_minute, now)
                       if limits.tokens_per_minute else None)
        self.daily = DailyQuota(limits.daily_tokens) if limits.daily_tokens else None
        self.active = 0  # requests in flight

    def update(self, limits: Limits, now: float) -> None:
        """New limits (a reloaded file): a changed limit starts again from a full bucket."""
        fresh = KeyLimiter(limits, now)
        if limits.requests_per_minute != self.limits.requests_per_minute:
            self.requests = fresh.requests
        if limits.tokens_per_minute != self.limits.tokens_per_minute:
            self.tokens = fresh.tokens
        if limits.daily_tokens != self.limits.daily_tokens:
            if fresh.daily is not None and self.daily is not None:
                fresh.daily.day, fresh.daily.used = self.daily.day, self.daily.used
            self.daily = fresh.daily
        self.limits = limits

    def arrive(self, name: str, now: float) -> None:
        """A request arrives: checks the concurrency limit and the daily quota, takes one
        from the requests bucket; raises `RateLimitError` (nothing taken) when over."""
        cap = self.limits.max_concurrent_requests
        if cap is not None and self.active >= cap:
            raise RateLimitError(f"the key {name!r} has {self.active} requests in flight, its "
                                 f"limit of concurrent requests; retry when one has ended", 1.0,
                                 "concurrent")
        if self.daily is not None and self.daily.left(now) <= 0:
            raise RateLimitError(
                f"the key {name!r} has used its daily quota of {self.daily.limit} tokens; it "
                "resets at 00:00 UTC", DailyQuota.until_reset(now), "daily_tokens")
        if self.requests is not None:
            wait = self.requests.wait(1, now)
            if wait > 0:
                raise RateLimitError(
                    f"rate limit reached for the key {name!r}: "
                    f"{self.requests.capacity} requests per minute", wait)
            self.requests.take(1)
        self.active += 1

    def leave(self) -> None:
        """A request's answer has ended."""
        self.active -= 1

    def reserve(self, name: str, tokens: int, now: float) -> Reservation:
        """Reserves a generation's most possible tokens; `RateLimitError` when the tokens
        bucket or the daily quota cannot hold them (nothing is taken then)."""
        if self.tokens is not None:
            wait = self.tokens.wait(tokens, now)
            if math.isinf(wait):
                raise RateLimitError(
                    f"request too large for the key {name!r}: it may use {tokens} tokens "
                    f"(prompt plus max_tokens), the limit is {self.tokens.capacity} tokens per "
                    "minute; lower max_tokens or shorten the prompt", 60.0, "tokens")
            if wait > 0:
                raise RateLimitError(
                    f"rate limit reached for the key {name!r}: {self.tokens.capacity} tokens "
                    f"per minute; this request may use {tokens} (prompt plus max_tokens), "
                    f"{self.tokens.remaining(now)} are left", wait, "tokens")
        day = None
        if self.daily is not None:
            left = self.daily.left(now)
            if tokens > left:
                raise RateLimitError(
                    f"the key {name!r} has {left} tokens left of its daily quota of "
                    f"{self.daily.limit}; this request may use {tokens} (prompt plus "
                    "max_tokens)", DailyQuota.until_reset(now), "daily_tokens")
            self.daily.used += tokens
            day = self.daily.day
        if self.tokens is not None:
            self.tokens.take(tokens)
        return Reservation(tokens, day)

    def settle(self, reservation: Reservation, used: int, now: float) -> None:
        """Corrects a reservation to the tokens actually used (once, at the request's end)."""
        delta = used - reservation.tokens
        if self.tokens is not None:
            self.tokens.refill(now)
            self.tokens.take(delta)
        if self.daily is not None and reservation.day is not None:
            self.daily.roll(now)
            if self.daily.day == reservation.day:
                self.daily.used = max(0, self.daily.used + delta)

    def headers(self, now: float) -> dict[str, str]:
        """OpenAI's x-ratelimit-* headers for the limits this key has."""
        out = {}
        for kind, bucket in (("requests", self.requests), ("tokens", self.tokens)):
            if bucket is not None:
                out[f"x-ratelimit-limit-{kind}"] = str(bucket.capacity)
                out[f"x-ratelimit-remaining-{kind}"] = str(bucket.remaining(now))
                out[f"x-ratelimit-reset-{kind}"] = duration(bucket.until_full(now))
        return out


class Limiter:
    """Every key's limiter, by key digest, kept across reloads of the key file.

    clock: seconds since the epoch (time.time); tests set their own.
    """

    def __init__(self, clock: Callable[[], float] = time.time):
        self.clock = clock
        self._keys: dict[bytes, KeyLimiter] = {}

    def of(self, key: ApiKey) -> KeyLimiter:
        """The live limiter of `key` (made on first use; its limits follow the key's)."""
        lim = self._keys.get(key.digest)
        if lim is None:
            lim = self._keys[key.digest] = KeyLimiter(key.limits, self.clock())
        elif lim.limits != key.limits:
            lim.update(key.limits, self.clock())
        return lim

    def forget_except(self, digests: set[bytes]) -> None:
        """Drops the state of keys no longer configured (in-flight requests keep theirs)."""
        for d in list(self._keys):
            if d not in digests:
                del self._keys[d]


def duration(seconds: float) -> str:
    """OpenAI's (Go's) duration format: "20ms", "1s", "59s", "6m0s", "1h0m0s"."""
    if seconds <= 0:
        return "0s"
    seconds = round(seconds, 6)  # float noise must not round 20 s up to 21
    if seconds < 0.999:
        return f"{math.ceil(seconds * 1000)}ms"
    s = math.ceil(seconds)
    h, rest = divmod(s, 3600)
    m, s = divmod(rest, 60)
    if h:
        return f"{h}h{m}m{s}s"
    if m:
        return f"{m}m{s}s"
    return f"{s}s"
