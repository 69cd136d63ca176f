"""Load generator for any OpenAI-compatible server: N concurrent streaming clients.

    python bench/serve.py --url http://127.0.0.1:8000 --concurrency 1 8 32 --requests 64 \\
        --prompt-len 128 --output-len 128

Each request streams a completion with `ignore_eos` (so every request makes exactly
`--output-len` tokens on servers that honour it) and a prompt of about `--prompt-len` tokens.
Prints, per concurrency: TTFT p50/p99, TPOT p50/p99 (time per output token after the first),
output tokens/s and requests/s. Only talks to the URL it is given.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import statistics
import sys
import time

WORDS = ("the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "seven",
         "wizards", "quietly", "hex", "every", "jolly", "box", "of", "frozen", "pizza")


@dataclasses.dataclass
class Result:
    """One request's timings."""

    ttft: float
    tpot: float | None
    tokens: int
    ok: bool


def _prompt(n_words: int, i: int) -> str:
    return f"{i}: " + " ".join(WORDS[(i + k) % len(WORDS)] for k in range(n_words))


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


async def _one(client, model: str, prompt: str, output_len: int) -> Result:
    start = time.perf_counter()
    first = last = None
    tokens = 0
    try:
        stream = await client.completions.create(
            model=model, prompt=prompt, max_tokens=output_len, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        async for chunk in stream:
            now = time.perf_counter()
            if chunk.choices and chunk.choices[0].text:
                first = first or now
                last = now
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
    except Exception as e:  # count it, keep going
        print(f"request failed: {e}", file=sys.stderr)
        return Result(float("nan"), None, 0, False)
    if first is None:
        return Result(float("nan"), None, tokens, False)
    tpot = (last - first) / (tokens - 1) if tokens > 1 else None
    return Result(first - start, tpot, tokens, True)


async def run(url: str, model: str | None, concurrency: int, requests: int, prompt_len: int,
              output_len: int, api_key: str) -> dict[str, float]:
    """Runs `requests` requests, `concurrency` at a time; returns the summary row."""
    import openai
    client = openai.AsyncOpenAI(base_url=url.rstrip("/") + "/v1", api_key=api_key,
                                max_retries=0, timeout=600)
    if model is None:
        model = (await client.models.list()).data[0].id
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(requests):
        queue.put_nowait(i)
    results: list[Result] = []

    async def worker() -> None:
        while not queue.empty():
            i = queue.get_nowait()
            results.append(await _one(client, model, _prompt(prompt_len, i), output_len))

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - start
    await client.close()
    ok = [r for r in results if r.ok]
    ttft = [r.ttft for r in ok]
    tpot = [r.tpot for r in ok if r.tpot is not None]
    return {"concurrency": concurrency, "requests": len(results), "failed": len(results) -
            len(ok), "ttft_p50": _pct(ttft, 50), "ttft_p99": _pct(ttft, 99),
            "tpot_p50": _pct(tpot, 50), "tpot_p99": _pct(tpot, 99),
            "tok_s": sum(r.tokens for r in ok) / wall, "req_s": len(ok) / wall}


def print_table(rows: list[dict[str, float]]) -> None:
    """Prints the summary rows as a table (times in milliseconds)."""
    head = (f"{'conc':>5} {'reqs':>5} {'fail':>4} {'TTFT p50':>9} {'TTFT p99':>9} "
            f"{'TPOT p50':>9} {'TPOT p99':>9} {'out tok/s':>10} {'req/s':>7}")
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['concurrency']:>5} {r['requests']:>5} {r['failed']:>4} "
              f"{r['ttft_p50'] * 1e3:>7.1f}ms {r['ttft_p99'] * 1e3:>7.1f}ms "
              f"{r['tpot_p50'] * 1e3:>7.1f}ms {r['tpot_p99'] * 1e3:>7.1f}ms "
              f"{r['tok_s']:>10.1f} {r['req_s']:>7.2f}")


def main(argv: list[str] | None = None) -> int:
    """Entry point: parses arguments, runs each concurrency level, prints the table."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL")
    p.add_argument("--model", default=None, help="model id (default: the first listed)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--requests", type=int, default=None,
                   help="requests per level (default: 4 x concurrency, at least 8)")
    p.add_argument("--prompt-len", type=int, default=128, help="prompt length in words")
    p.add_argument("--output-len", type=int, default=128, help="tokens to generate")
    p.add_argument("--api-key", default="unused")
    args = p.parse_args(argv)
    rows = []
    for c in args.concurrency:
        n = args.requests or max(8, 4 * c)
        rows.append(asyncio.run(run(args.url, args.model, c, n, args.prompt_len,
                                    args.output_len, args.api_key)))
    print_table(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
