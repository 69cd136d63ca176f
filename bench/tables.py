"""What several benchmarks print alike: the metrale-against-transformers table of greedy and
beam-search decoding (`bench/beam_search.py`, `bench/translate.py`). Imports nothing of the
project."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

Decode = Callable[[int], list[list[int]]]  # num_beams -> each prompt's output ids


def timed(fn: Decode, beams: int, rounds: int) -> tuple[float, list[list[int]]]:
    """(median seconds of `rounds` calls of `fn(beams)` after one warm-up call, the last
    call's outputs)."""
    fn(beams)  # compile / warm
    times, result = [], []
    for _ in range(rounds):
        t0 = time.perf_counter()
        result = fn(beams)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), result


def print_beams_table(ours: Decode, theirs: Decode, rounds: int, count: int) -> None:
    """Times metrale (`ours`) and transformers (`theirs`) at num_beams 1 and 4 on the same
    `count` prompts and prints one markdown row each: sentences/s and tokens/s of both,
    their ratio, and how many outputs have the same ids."""
    print("| decoding | metrale sent/s | metrale tok/s | transformers sent/s | "
          "transformers tok/s | metrale / transformers | same ids |")
    print("|---|---|---|---|---|---|---|")
    for beams in (1, 4):
        t_ours, a = timed(ours, beams, rounds)
        t_hf, b = timed(theirs, beams, rounds)
        n_a, n_b = sum(map(len, a)), sum(map(len, b))
        same = sum(x == y for x, y in zip(a, b, strict=True))
        print(f"| num_beams {beams} | {count / t_ours:.2f} | {n_a / t_ours:.1f} | "
              f"{count / t_hf:.2f} | {n_b / t_hf:.1f} | {t_hf / t_ours:.2f}x | "
              f"{same}/{count} |")
