"""Constrained decoding overhead: 16 concurrent requests, of which 0, 4 or 16 follow a JSON
schema (llguidance masks filled on the host each step, applied on the device).

Default model (real weights), greedy, 48 tokens per request, one engine for all three runs
(interleaved rounds, medians). Prints the mean decode step time (wall time / steps the
batching loop launched) and tokens/s, with ratios against no constrained request.

    .venv/bin/python bench/constrained.py [--rounds 3] [--tokens 48]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from metrale_jax import LLM, SamplingParams
from metrale_jax.scheduler import GenerationRequest
from metrale_jax.scheduler.constraints import Constraint

SCHEMA = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999},
          "minItems": 200}


def run(llm: LLM, constrained: int, tokens: int) -> tuple[float, float]:
    """(seconds per decode step, tokens/s) for 16 requests, `constrained` of them with SCHEMA."""
    sched = llm.scheduler
    prompt = llm.tokenizer.encode("List many numbers: ")
    handles = []
    steps0 = sched.stats["steps"]
    t0 = time.perf_counter()
    for i in range(16):
        c = Constraint.from_schema(SCHEMA) if i < constrained else None
        p = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True, constraint=c)
        handles.append(sched.submit(GenerationRequest.make(prompt, p)))
    done = 0
    for h in handles:
        for event in h:
            if type(event).__name__ == "Finished":
                done += event.completion_tokens
    dt = time.perf_counter() - t0
    return dt / max(1, sched.stats["steps"] - steps0), done / dt


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tokens", type=int, default=48)
    args = p.parse_args()
    llm = LLM("default", max_slots=16, max_len=512, max_prefill_len=64)
    run(llm, 16, 8)  # builds the llguidance tokenizer and warms the path
    results: dict[int, list[tuple[float, float]]] = {0: [], 4: [], 16: []}
    for _ in range(args.rounds):
        for n in results:
            results[n].append(run(llm, n, args.tokens))
    base = float(np.median([r[0] for r in results[0]]))
    print("Metrale-JAX constrained decoding, default model, 16 slots, greedy, "
          f"{args.tokens} tokens per request")
    for n, rs in results.items():
        step = float(np.median([r[0] for r in rs]))
        rate = float(np.median([r[1] for r in rs]))
        print(f"  {n:2d} of 16 constrained: step {step * 1000:6.1f} ms ({step / base:4.2f}x)  "
              f"{rate:6.1f} tok/s")
    print(f"  compiles: {llm.scheduler.engine.compile_count} (all at warmup)")
    llm.close()


if __name__ == "__main__":
    main()
