"""The prefix cache on and off, side by side: multi-turn chat, a shared system prompt, no reuse.

Starts two `metrale serve` processes of this checkout on the default model (loopback ports,
the same flags, one with `--no-prefix-cache`) and runs each workload against one, then the
other, the order alternating from one workload to the next (only one is ever busy), streaming
chat with the official `openai` client:

1. multi-turn: C conversations at once, T turns each; every conversation has its own system
   prompt of about 400 tokens and each turn adds a user message of about 60 tokens (the
   answers, `--answer-len` tokens, go back into the history): TTFT p50 per turn;
2. shared system prompt: N requests at once with one ~1,000-token system prompt (sent once
   before, unmeasured, as a server that has been serving it has it) and different questions:
   TTFT p50 / p99 and output tok/s;
3. no reuse: N distinct prompts of about 300 tokens, `--no-reuse-concurrency` at a time:
   output tok/s and TTFT p50.

    .venv/bin/python bench/prefix_cache.py
    .venv/bin/python bench/prefix_cache.py --conversations 8 --turns 6 --shared 32
    .venv/bin/python bench/prefix_cache.py --workloads multi-turn --old /tmp/old-checkout

Prints one table per workload. `--old ROOT` also starts both servers from another checkout
(e.g. `git worktree add /tmp/old-checkout <commit>`), the four taking turns per workload, and
prints the multi-turn table for each checkout (the side-by-side the commit before);
`--workloads` picks the workloads. Only 127.0.0.1 is contacted.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.paged_server import HERE, start_server

_VOCABULARY = ("time person year way day thing man world life hand part child eye woman place work "
         "week case point government company number group problem fact river mountain garden "
         "window table letter music story color paper money light market energy science "
         "history country summer winter morning evening island forest ocean village bridge "
         "engine signal pattern memory picture question answer reason moment season doctor "
         "teacher student kitchen station theory method result nature future animal travel "
         "simple quiet bright gentle rapid careful honest narrow ancient modern famous")
WORDS = _VOCABULARY.split()


def text(rng: random.Random, words: int) -> str:
    """`words` random words (about 1.2 tokens each on the default model's tokenizer)."""
    return " ".join(rng.choice(WORDS) for _ in range(words))


def pct(values: list[float], q: float) -> float:
    """The q-th percentile (0..100) by nearest rank."""
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))]


async def chat(client, messages: list[dict], max_tokens: int) -> dict:
    """One streamed chat request: TTFT (first content), output tokens, text, cached tokens."""
    t0 = time.perf_counter()
    ttft = None
    parts: list[str] = []
    usage = None
    stream = await client.chat.completions.create(
        model="default", messages=messages, max_tokens=max_tokens, temperature=0.0,
        stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta.content:
                if ttft is None:
                    ttft = time.perf_counter() - t0
                parts.append(choice.delta.content)
    cached = 0
    if usage is not None and usage.prompt_tokens_details is not None:
        cached = usage.prompt_tokens_details.cached_tokens or 0
    return {"ttft": ttft if ttft is not None else time.perf_counter() - t0,
            "e2e": time.perf_counter() - t0, "text": "".join(parts),
            "out": usage.completion_tokens if usage else 0,
            "prompt": usage.prompt_tokens if usage else 0, "cached": cached}


async def multi_turn(client, args) -> dict[int, list[dict]]:
    """Per turn, every conversation's result."""
    per_turn: dict[int, list[dict]] = {t: [] for t in range(1, args.turns + 1)}

    async def conversation(c: int) -> None:
        rng = random.Random(1000 + c)
        messages = [{"role": "system", "content": f"Conversation {c}. " + text(rng, 330)}]
        for turn in range(1, args.turns + 1):
            messages.append({"role": "user", "content": text(rng, 50)})
            r = await chat(client, messages, args.answer_len)
            per_turn[turn].append(r)
            messages.append({"role": "assistant", "content": r["text"]})

    await asyncio.gather(*(conversation(c) for c in range(args.conversations)))
    return per_turn


async def shared_prompt(client, args) -> tuple[list[dict], float]:
    rng = random.Random(2000)
    system = {"role": "system", "content": text(rng, 830)}
    await chat(client, [system, {"role": "user", "content": "Hello."}], 4)  # unmeasured
    questions = [text(random.Random(3000 + i), 15) for i in range(args.shared)]
    t0 = time.perf_counter()
    results = await asyncio.gather(*(
        chat(client, [system, {"role": "user", "content": q}], args.answer_len)
        for q in questions))
    return results, time.perf_counter() - t0


async def no_reuse(client, args) -> tuple[list[dict], float]:
    sem = asyncio.Semaphore(args.no_reuse_concurrency)

    async def one(i: int) -> dict:
        rng = random.Random(4000 + i)
        async with sem:
            return await chat(client, [{"role": "user", "content": text(rng, 250)}],
                              args.answer_len)

    t0 = time.perf_counter()
    results = await asyncio.gather(*(one(i) for i in range(args.shared)))
    return results, time.perf_counter() - t0


WORKLOADS = {"multi-turn": multi_turn, "shared": shared_prompt, "no-reuse": no_reuse}


async def run_all(urls: dict[str, str], args) -> dict:
    from openai import AsyncOpenAI
    clients = {name: AsyncOpenAI(base_url=f"{url}/v1", api_key="none", timeout=3600,
                                 max_retries=0) for name, url in urls.items()}
    out: dict[str, dict] = {name: {} for name in urls}
    names = list(clients)
    for i, workload in enumerate(args.workloads):
        fn = WORKLOADS[workload]
        # Alternate which server goes first, so neither always meets a cold machine first.
        for name in names if i % 2 == 0 else names[::-1]:
            client = clients[name]
            print(f"{workload}: {name} ...", file=sys.stderr, flush=True)
            out[name][workload] = await fn(client, args)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--shared", type=int, default=32,
                    help="requests of the shared-prompt and no-reuse workloads")
    ap.add_argument("--no-reuse-concurrency", type=int, default=8)
    ap.add_argument("--answer-len", type=int, default=32)
    ap.add_argument("--max-slots", type=int, default=8)
    ap.add_argument("--max-len", type=int, default=2048)
    ap.add_argument("--start-timeout", type=float, default=1800.0)
    ap.add_argument("--workloads", nargs="+", choices=list(WORKLOADS), default=list(WORKLOADS))
    ap.add_argument("--warmup", choices=["serve", "full"], default="serve",
                    help="the servers' --warmup (full: every program compiled before the "
                         "first request, so no background compile competes with the runs)")
    ap.add_argument("--old", metavar="ROOT",
                    help="another checkout (the commit before) served side by side")
    ap.add_argument("--old-first", action="store_true",
                    help="run the other checkout's servers first (alternate between runs)")
    args = ap.parse_args()
    roots = {"": str(HERE)} | ({"old ": args.old} if args.old else {})
    if args.old_first:
        roots = dict(reversed(roots.items()))
    with tempfile.TemporaryDirectory() as tmp:
        servers = {}
        try:
            for tag, root in roots.items():
                warm = ["--warmup", args.warmup]
                servers[f"{tag}on"] = start_server(root, args, f"{tmp}/{tag}on.log", warm)
                servers[f"{tag}off"] = start_server(root, args, f"{tmp}/{tag}off.log",
                                                    [*warm, "--no-prefix-cache"])
            res = asyncio.run(run_all({k: url for k, (_, url) in servers.items()}, args))
        finally:
            for proc, _ in servers.values():
                proc.terminate()
                proc.wait(timeout=60)

    for tag in roots if "multi-turn" in args.workloads else ():
        print(f"\nMulti-turn{' (' + args.old + ')' if tag else ''}: {args.conversations} "
              f"conversations x {args.turns} turns, TTFT p50 s (prompt tokens p50; cached p50 "
              "with the cache)\n")
        print("| turn | prompt tokens | cache off | cache on | cached tokens | on/off |")
        print("|---|---|---|---|---|---|")
        for turn in range(1, args.turns + 1):
            on, off = res[f"{tag}on"]["multi-turn"][turn], res[f"{tag}off"]["multi-turn"][turn]
            a = statistics.median(r["ttft"] for r in off)
            b = statistics.median(r["ttft"] for r in on)
            print(f"| {turn} | {statistics.median(r['prompt'] for r in on):.0f} | {a:.2f} | "
                  f"{b:.2f} | {statistics.median(r['cached'] for r in on):.0f} | "
                  f"{b / a:.2f}x |")

    for workload, title in (("shared", f"Shared system prompt: {args.shared} requests at once"),
                            ("no-reuse", f"No reuse: {args.shared} distinct prompts, "
                                         f"{args.no_reuse_concurrency} at a time")):
        if workload not in args.workloads:
            continue
        print(f"\n{title}\n")
        print("| cache | prompt tokens p50 | cached p50 | TTFT p50 s | TTFT p99 s | out tok/s |")
        print("|---|---|---|---|---|---|")
        rates = {}
        for name in ("off", "on"):
            results, wall = res[name][workload]
            ttfts = [r["ttft"] for r in results]
            rates[name] = sum(r["out"] for r in results) / wall
            print(f"| {name} | {statistics.median(r['prompt'] for r in results):.0f} | "
                  f"{statistics.median(r['cached'] for r in results):.0f} | "
                  f"{pct(ttfts, 50):.2f} | {pct(ttfts, 99):.2f} | {rates[name]:.1f} |")
        print(f"| on/off | | | | | {rates['on'] / rates['off']:.2f}x |")


if __name__ == "__main__":
    main()
