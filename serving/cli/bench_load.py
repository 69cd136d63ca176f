"""The load generator behind `metrale bench`: N concurrent clients against any OpenAI URL.

Each level runs `requests` requests with at most `concurrency` in flight (one thread per
client; the work is waiting on sockets). Prompt and output lengths are drawn per request from
`Dist`s with a seeded generator, so a run is repeatable. Prompts are words from a fixed list
(about one token each; the real counts come back in `usage`), each prefixed with its index so
no two requests share a prompt. Streaming requests measure:

- TTFT: from sending the request to the first chunk with text (or, for an answer whose tokens
  all decode to no text, to its finishing chunk);
- TPOT: time per output token after the first, (last chunk - first chunk) / (tokens - 1);
- e2e: from sending to the end of the answer; a request's throughput is tokens / e2e.

Non-streaming requests measure e2e and throughput only. Only the URL given is contacted.
"""

from __future__ import annotations

import dataclasses
import math
import random
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from metrale_jax.errors import InvalidParameterError
from serving.cli.http_client import Client

WORDS = ("the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "seven",
         "wizards", "quietly", "hex", "every", "jolly", "box", "of", "frozen", "pizza")
PERCENTILES = (50, 90, 99)


@dataclasses.dataclass(frozen=True)
class Dist:
    """A distribution of lengths ≥ 1: "128" (fixed), "64:256" (uniform, both ends included)
    or "normal:128:32" (mean, standard deviation; rounded, clipped at 1)."""

    kind: str
    a: float
    b: float = 0.0

    def sample(self, rng: random.Random) -> int:
        """One length."""
        if self.kind == "fixed":
            return int(self.a)
        if self.kind == "uniform":
            return rng.randint(int(self.a), int(self.b))
        return max(1, round(rng.gauss(self.a, self.b)))

    def __str__(self) -> str:
        if self.kind == "fixed":
            return f"{int(self.a)}"
        if self.kind == "uniform":
            return f"{int(self.a)}:{int(self.b)}"
        return f"normal:{self.a:g}:{self.b:g}"


def parse_dist(text: str, flag: str = "length") -> Dist:
    """Parses a `Dist` spec; raises `InvalidParameterError` naming `flag`."""
    bad = InvalidParameterError(f"{flag} {text!r}: give N, A:B (uniform) or normal:MEAN:STD, "
                                "with lengths ≥ 1", param=flag)
    parts = text.strip().split(":")
    try:
        if len(parts) == 1:
            dist = Dist("fixed", int(parts[0]))
        elif len(parts) == 2:
            dist = Dist("uniform", int(parts[0]), int(parts[1]))
        elif len(parts) == 3 and parts[0] == "normal":
            dist = Dist("normal", float(parts[1]), float(parts[2]))
        else:
            raise bad
    except ValueError:
        raise bad from None
    if dist.a < 1 or (dist.kind == "uniform" and dist.b < dist.a) or (
            dist.kind == "normal" and (dist.b < 0 or not math.isfinite(dist.a + dist.b))):
        raise bad
    return dist


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    """What every request of a run looks like.

    endpoint: "completions" or "chat". ignore_eos: ask the server to generate exactly the
    drawn output length (vLLM's and Metrale's extension; other servers may ignore it).
    """

    model: str
    endpoint: str = "completions"
    stream: bool = True
    prompt_len: Dist = Dist("fixed", 128)
    output_len: Dist = Dist("fixed", 128)
    ignore_eos: bool = True
    temperature: float = 0.0
    seed: int = 0


@dataclasses.dataclass
class RequestResult:
    """One request's outcome; times in seconds (None where not measured)."""

    index: int
    prompt_words: int
    max_tokens: int
    ok: bool = False
    error: str | None = None
    start: float = 0.0
    ttft: float | None = None
    tpot: float | None = None
    e2e: float | None = None
    prompt_tokens: int | None = None
    output_tokens: int = 0

    @property
    def tokens_per_s(self) -> float | None:
        """This request's output tokens per second of its e2e time."""
        return self.output_tokens / self.e2e if self.ok and self.e2e else None


@dataclasses.dataclass
class LevelResult:
    """All requests of one concurrency level, and its wall time."""

    concurrency: int
    wall_s: float
    results: list[RequestResult]


def make_prompt(words: int, index: int) -> str:
    """A prompt of about `words` tokens, unique to `index`."""
    return f"{index}: " + " ".join(WORDS[(index + k) % len(WORDS)] for k in range(words))


def _body(cfg: BenchConfig, prompt: str, max_tokens: int) -> tuple[str, dict[str, Any]]:
    body: dict[str, Any] = {"model": cfg.model, "max_tokens": max_tokens,
                            "temperature": cfg.temperature, "stream": cfg.stream}
    if cfg.stream:
        body["stream_options"] = {"include_usage": True}
    if cfg.ignore_eos:
        body["ignore_eos"] = True
    if cfg.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
        return "/v1/chat/completions", body
    body["prompt"] = prompt
    return "/v1/completions", body


def _text_of(choice: dict[str, Any]) -> str:
    return choice.get("text") or (choice.get("delta") or {}).get("content") or ""


def run_one(client: Client, cfg: BenchConfig, r: RequestResult, t0: float) -> RequestResult:
    """Sends one request and fills in `r` (never raises for a failed request)."""
    path, body = _body(cfg, make_prompt(r.prompt_words, r.index), r.max_tokens)
    start = time.perf_counter()
    r.start = start - t0
    try:
        if not cfg.stream:
            answer = client.post_json(path, body)
            r.e2e = time.perf_counter() - start
            usage = answer.get("usage") or {}
            r.output_tokens = int(usage.get("completion_tokens") or 0)
            r.prompt_tokens = usage.get("prompt_tokens")
            r.ok = r.output_tokens > 0
            r.error = None if r.ok else "no tokens generated"
            return r
        first = last = None
        chunks = 0
        usage_tokens = None
        with client.stream(path, body) as events:
            for event in events:
                now = time.perf_counter()
                choices = event.get("choices") or ()
                if any(_text_of(c) for c in choices):
                    first = first or now
                    last = now
                    chunks += 1
                elif any(c.get("finish_reason") for c in choices):
                    first = first or now  # every token was one without text (special)
                    last = last or now
                usage = event.get("usage")
                if usage:
                    usage_tokens = usage.get("completion_tokens")
                    r.prompt_tokens = usage.get("prompt_tokens")
        r.e2e = time.perf_counter() - start
    except Exception as e:  # a failed request is counted and reported, the run goes on
        r.e2e = time.perf_counter() - start
        r.error = f"{type(e).__name__}: {e}"
        return r
    r.output_tokens = int(usage_tokens if usage_tokens is not None else chunks)
    if first is None or r.output_tokens == 0:
        r.error = "no tokens streamed"
        return r
    r.ok = True
    r.ttft = first - start
    # Two text chunks at least, or the gaps between tokens were not seen.
    r.tpot = (last - first) / (r.output_tokens - 1) if chunks > 1 and r.output_tokens > 1 \
        else None
    return r


def plan(cfg: BenchConfig, requests: int, level: int) -> list[RequestResult]:
    """The requests of one level with their drawn lengths (seeded by cfg.seed and level)."""
    rng = random.Random(f"{cfg.seed}-{level}")
    return [RequestResult(i, cfg.prompt_len.sample(rng), cfg.output_len.sample(rng))
            for i in range(requests)]


def run_level(client: Client, cfg: BenchConfig, concurrency: int, requests: int,
              on_done: Callable[[int, int], None] | None = None) -> LevelResult:
    """Runs `requests` requests with `concurrency` in flight; `on_done(done, total)` after each."""
    todo = plan(cfg, requests, concurrency)
    lock = threading.Lock()
    done = [0]

    def one(r: RequestResult) -> RequestResult:
        run_one(client, cfg, r, t0)
        with lock:
            done[0] += 1
            if on_done is not None:
                on_done(done[0], len(todo))
        return r

    t0 = time.perf_counter()
    pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="bench")
    try:
        results = list(pool.map(one, todo))
    except BaseException:  # Ctrl-C: send nothing more (requests in flight end on their own)
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown()
    return LevelResult(concurrency, time.perf_counter() - t0, results)


def percentiles(values: Sequence[float]) -> dict[int, float | None]:
    """p50/p90/p99 (linear interpolation); None for no values."""
    if not values:
        return dict.fromkeys(PERCENTILES)
    arr = np.asarray(values, dtype=np.float64)
    return {q: float(np.percentile(arr, q)) for q in PERCENTILES}


def summarize(level: LevelResult) -> dict[str, Any]:
    """The summary row of a level: counts, percentiles (seconds, tok/s), aggregate rates."""
    ok = [r for r in level.results if r.ok]
    row: dict[str, Any] = {"concurrency": level.concurrency, "requests": len(level.results),
                           "failed": len(level.results) - len(ok), "wall_s": level.wall_s}
    series = {"ttft": [r.ttft for r in ok if r.ttft is not None],
              "tpot": [r.tpot for r in ok if r.tpot is not None],
              "e2e": [r.e2e for r in ok if r.e2e is not None],
              "tok_s": [r.tokens_per_s for r in ok if r.tokens_per_s is not None]}
    for name, values in series.items():
        for q, v in percentiles(values).items():
            row[f"{name}_p{q}"] = v
    tokens = sum(r.output_tokens for r in ok)
    row["output_tokens"] = tokens
    row["output_tok_s"] = tokens / level.wall_s if level.wall_s > 0 else 0.0
    row["req_s"] = len(ok) / level.wall_s if level.wall_s > 0 else 0.0
    prompts = [r.prompt_tokens for r in ok if r.prompt_tokens is not None]
    row["mean_prompt_tokens"] = sum(prompts) / len(prompts) if prompts else None
    row["mean_output_tokens"] = tokens / len(ok) if ok else None
    return row
