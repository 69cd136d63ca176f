"""An urgent request among busy rows: its latency with and without a better priority.

The default model with `--slots` rows, all held by long generations (`--background-tokens`
each, priority 0), when one short request (`--urgent-tokens`) arrives. With priority 0 it
waits for a row to free; with priority -1 it preempts the newest background row (which is
recomputed later). The two cases alternate in one run (`--rounds` each); prints the urgent
request's time to its last token (median), the background batch's wall time, and how many
rows were preempted.

    .venv/bin/python bench/priority.py
    .venv/bin/python bench/priority.py --slots 4 --background-tokens 96 --rounds 2
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--slots", type=int, default=4)
    p.add_argument("--background-tokens", type=int, default=96)
    p.add_argument("--urgent-tokens", type=int, default=8)
    p.add_argument("--rounds", type=int, default=2, help="timed runs per case (median)")
    args = p.parse_args()

    from metrale_jax import LLM, SamplingParams
    from metrale_jax.completion import collect
    from metrale_jax.scheduler import GenerationRequest

    llm = LLM("default", max_slots=args.slots, max_len=512, max_prefill_len=64)
    sched = llm.scheduler
    bg = SamplingParams(max_tokens=args.background_tokens, temperature=0, ignore_eos=True)
    urgent = SamplingParams(max_tokens=args.urgent_tokens, temperature=0, ignore_eos=True)
    prompts = [llm.tokenizer.encode(f"Tell me a long story about the number {i}.")
               for i in range(args.slots)]
    question = llm.tokenizer.encode("The capital of France is")
    llm.generate([*prompts, question], bg)  # compile what the runs use

    def run(priority: int) -> tuple[float, float, int]:
        before = sched.stats["preempted_by_priority"]
        start = time.perf_counter()
        handles = [sched.submit(GenerationRequest.make(ids, bg)) for ids in prompts]
        while sum(s is not None for s in sched.snapshot()["slots"]) < args.slots:
            time.sleep(0.005)  # every row busy (a benchmark may wait; a test may not)
        time.sleep(0.2)  # a few tokens into the background
        sent = time.perf_counter()
        collect(sched.submit(GenerationRequest.make(question, urgent, priority=priority)))
        latency = time.perf_counter() - sent
        for h in handles:
            collect(h)
        return latency, time.perf_counter() - start, sched.stats["preempted_by_priority"] - before

    results: dict[int, list[tuple[float, float, int]]] = {0: [], -1: []}
    for _ in range(args.rounds):
        for priority in (0, -1):
            results[priority].append(run(priority))
    print(f"| urgent priority | urgent latency s | background wall s | preempted "
          f"| ({args.slots} rows x {args.background_tokens} tokens, urgent "
          f"{args.urgent_tokens}) |")
    print("|---|---|---|---|---|")
    for priority, rows in results.items():
        lat = statistics.median(r[0] for r in rows)
        wall = statistics.median(r[1] for r in rows)
        print(f"| {priority} | {lat:.2f} | {wall:.2f} | {sum(r[2] for r in rows)} | |")
    base = statistics.median(r[0] for r in results[0])
    best = statistics.median(r[0] for r in results[-1])
    print(f"urgent latency ratio (priority -1 / 0): {best / base:.2f}")
    llm.close()


if __name__ == "__main__":
    main()
